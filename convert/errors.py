"""Error types. Every message names the file and/or tensor and what is wrong, in one line.

The CLI prints ``error: <message>`` and exits with status 2 for any :class:`G4Error` (and
for an ``OSError``: a file that cannot be read or written). Any other exception is a broken
internal invariant and stays a traceback: the CLI never turns a bare ``ValueError`` into a
user error.
"""

import functools
import signal
import sys


class G4Error(Exception):
    """Base class for input and output problems the user can act on."""


class CheckpointError(G4Error, ValueError):
    """The source checkpoint is missing files, corrupt, inconsistent or not Gemma 4."""


class MappingError(G4Error, KeyError):
    """A source tensor has no rule in the target's name table (or a rule has no tensor)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class OptionError(G4Error, ValueError):
    """A value given for an option or argument cannot be used (e.g. a size without its unit)."""


class ExportError(G4Error, ValueError):
    """The output would be invalid (non-finite scales, inconsistent metadata) or cannot be placed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised by :func:`raise_terminated`; a KeyboardInterrupt so that everything
    that cleans up after Ctrl-C cleans up after it too."""


def raise_terminated(signum, frame):
    """Signal handler for SIGTERM (``signal.signal(signal.SIGTERM, raise_terminated)``).

    Raises:
        Terminated: always, in the main thread.
    """
    raise Terminated


def exit_on_user_error(fn):
    """Decorator for CLI commands: a :class:`G4Error` prints ``error: <message>`` (one line)
    on stderr and exits with status 2; Ctrl-C exits with 130 and SIGTERM (with
    :func:`raise_terminated` installed) with 143, 128 + the signal number as shells report
    it (outputs are only ever renamed into place when complete, so nothing partial is left)."""

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
        except KeyboardInterrupt as e:
            sig = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
            click.echo(f"{'terminated' if sig == signal.SIGTERM else 'interrupted'}; nothing was written to OUT",
                       err=True)
            sys.exit(128 + sig)

    return wrapper
