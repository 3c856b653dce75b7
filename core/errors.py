"""Error types. Every message names the file and/or tensor and what is wrong, in one line.

The CLI prints ``error: <message>`` and exits with status 2 for any :class:`G4Error` (and
for an ``OSError``: a file that cannot be read or written). Any other exception is a broken
internal invariant and stays a traceback: the CLI never turns a bare ``ValueError`` into a
user error.
"""

import functools
import inspect
import os
import signal
import sys

# Letters whose English names begin with a vowel sound (eff, aitch, ell, em, en, ar, ess, ex):
# an initialism starting with one takes "an" (an NVFP4 result, an MLP, an HF token).
_VOWEL_SOUND_LETTERS = frozenset("AEFHILMNORSX")
# Words starting with a vowel letter but a consonant sound ("a user", "a one-line").
_CONSONANT_SOUND_STARTS = ("one", "once", "uni", "usa", "use", "usi", "usu", "uti", "eu", "ewe")


def a_or_an(word: str) -> str:
    """``word`` with its indefinite article, for messages built around a name or kind:
    ``a_or_an("NVFP4 result")`` is ``"an NVFP4 result"``, ``"int8-neuron result"`` ->
    ``"an int8-neuron result"``, ``"bf16 checkpoint"`` -> ``"a bf16 checkpoint"``,
    ``"'image_url'"`` -> ``"an 'image_url'"``, ``"user"`` -> ``"a user"``, ``"8-byte"`` ->
    ``"an 8-byte"``. Leading quotes and backticks are skipped; an initialism (its first two
    letters upper case, or a letter followed by a digit) is read letter by letter."""
    bare = word.lstrip("'\"`(")
    head = bare.split(" ", 1)[0].split("-", 1)[0]
    if not head:
        return word  # nothing to read an article from
    first = head[0]
    initialism = len(head) > 1 and first.isalpha() and (head[:2].isupper() or head[1].isdigit())
    if first.isdigit():
        digits = head[: len(head) - len(head.lstrip("0123456789"))]
        # 8, 11, 18, 80-89, 800-899, 11000 ...: numbers read with a leading vowel sound
        vowel = first == "8" or (digits[:2] in ("11", "18") and len(digits) % 3 == 2)
    elif initialism:
        vowel = first.upper() in _VOWEL_SOUND_LETTERS
    else:
        vowel = first.lower() in "aeiou" and not head.lower().startswith(_CONSONANT_SOUND_STARTS)
    return f"{'an' if vowel else 'a'} {word}"


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


# Signals taken by the handlers below, in order, and the outputs placed (renamed into place) so
# far: an exception a library swallows (a broad ``except`` in torch.compile, say) does not lose
# the signal, and the exit message says whether OUT was already complete.
_received: list[int] = []
_placed: list[str] = []


def raise_terminated(signum, frame):
    """Signal handler for SIGTERM (``signal.signal(signal.SIGTERM, raise_terminated)``); the
    signal is recorded (:func:`signal_received`).

    Raises:
        Terminated: always, in the main thread.
    """
    _received.append(signal.SIGTERM)
    raise Terminated


def raise_interrupted(signum, frame):
    """Signal handler for SIGINT: Python's own (KeyboardInterrupt), with the signal recorded.

    Raises:
        KeyboardInterrupt: always, in the main thread.
    """
    _received.append(signal.SIGINT)
    raise KeyboardInterrupt


def install_signal_handlers() -> None:
    """SIGTERM and SIGINT raise (:class:`Terminated`, KeyboardInterrupt) and are recorded
    (what was recorded by an earlier command in this process is forgotten)."""
    _received.clear()
    _placed.clear()
    signal.signal(signal.SIGTERM, raise_terminated)
    signal.signal(signal.SIGINT, raise_interrupted)


def guard_start_up() -> None:
    """For a console script, before its heavy imports (torch, transformers: seconds): until
    the command installs its own handlers, SIGINT or SIGTERM ends the process at once with one
    line and exit status 130 / 143, without a traceback (nothing has been written yet)."""
    def stop(signum, frame):
        what = "terminated" if signum == signal.SIGTERM else "interrupted"
        os.write(2, f"{what} while starting; nothing was written\n".encode())
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def signal_received() -> int | None:
    """The last SIGINT / SIGTERM the handlers took, or None."""
    return _received[-1] if _received else None


def raise_if_signalled() -> None:
    """Raise again the signal's exception when a signal was taken (whether or not its
    exception reached anyone): call before an irreversible step such as placing OUT.

    Raises:
        Terminated, KeyboardInterrupt: after SIGTERM, SIGINT.
    """
    sig = signal_received()
    if sig == signal.SIGTERM:
        raise Terminated
    if sig == signal.SIGINT:
        raise KeyboardInterrupt


def note_output_placed(out) -> None:
    """Record that ``out`` is complete and in place (for the message of a later signal)."""
    _placed.append(str(out))


def _signal_exit(sig: int, has_out: bool = True) -> None:
    import click

    what = "terminated" if sig == signal.SIGTERM else "interrupted"
    if _placed:
        click.echo(f"{what} after {', '.join(_placed)} was complete; it is kept", err=True)
    elif has_out:
        click.echo(f"{what}; nothing was written to OUT", err=True)
    else:  # e.g. g4convert kernels: a cache entry is renamed into place only when complete
        click.echo(f"{what}; nothing partial was left", err=True)
    # handled: a caller that goes on in this process (click's test runner, a program calling
    # the CLI) must not have its next conversion stopped by raise_if_signalled
    _received.clear()
    _placed.clear()
    sys.exit(128 + sig)


def exit_on_user_error(fn):
    """Decorator for CLI commands: a :class:`G4Error` prints ``error: <message>`` (one line)
    on stderr and exits with status 2; Ctrl-C exits with 130 and SIGTERM (with
    :func:`install_signal_handlers`) with 143, 128 + the signal number as shells report
    it (outputs are only ever renamed into place when complete, so nothing partial is left),
    also when something on the way swallowed the signal's exception, and also when the signal
    came after OUT was placed (the message then says OUT is complete and kept). A command
    without an ``out`` parameter is not said to have left OUT untouched."""
    has_out = "out" in inspect.signature(fn).parameters

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import click

        try:
            result = fn(*args, **kwargs)
        except G4Error as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except OSError as e:  # permissions, full disk, ...: the file and the reason, not a traceback
            where = f"{e.filename}: " if getattr(e, "filename", None) else ""
            click.echo(f"error: {where}{e.strerror or e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as e:
            _signal_exit(signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT, has_out)
        if (sig := signal_received()) is not None:  # its exception was swallowed on the way
            _signal_exit(sig, has_out)
        return result

    return wrapper
