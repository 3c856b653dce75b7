"""Error types. Every message names the file and/or tensor and what is wrong, in one line.

The CLI prints ``error: <message>`` and exits with status 2 for any :class:`G4Error`.
"""

import functools
import sys


class G4Error(Exception):
    """Base class for input and output problems the user can act on."""


class CheckpointError(G4Error, ValueError):
    """The source checkpoint is missing files, corrupt, inconsistent or not Gemma 4."""


class MappingError(G4Error, KeyError):
    """A source tensor has no rule in the target's name table (or a rule has no tensor)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ExportError(G4Error, ValueError):
    """The output would be invalid (non-finite scales, inconsistent metadata) or cannot be placed."""


def exit_on_user_error(fn):
    """Decorator for CLI commands: a :class:`G4Error` prints ``error: <message>`` (one line)
    on stderr and exits with status 2; Ctrl-C exits with 130 (outputs are only ever
    renamed into place when complete, so nothing partial is left)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import click

        try:
            return fn(*args, **kwargs)
        except G4Error as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except OSError as e:  # permissions, full disk, ...: the file and the reason, not a traceback
            where = f"{e.filename}: " if getattr(e, "filename", None) else ""
            click.echo(f"error: {where}{e.strerror or e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted; nothing was written to OUT", err=True)
            sys.exit(130)

    return wrapper
