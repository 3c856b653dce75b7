"""The output directory as one transaction: a result appears at OUT only when complete.

:func:`atomic_output_dir` gives the conversion a fresh temporary folder beside OUT, holds a lock
on OUT against a concurrent run, keeps signals from splitting the final rename, and renames
the finished folder into place (``renameat2(RENAME_NOREPLACE | RENAME_EXCHANGE)`` where Linux
has it); a run that dies leaves OUT as it was, and the next run cleans up what it left.
``--overwrite`` replaces only a g4 result and never deletes a file g4 did not write
(:func:`foreign_files`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import fnmatch
import json
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from g4.core.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG, INDEX_NAME, SIDE_FILE_PATTERNS, SINGLE_NAME
from g4.core.errors import CheckpointError, ExportError, note_output_placed, raise_if_signalled, signal_received
from g4.core.sizes import format_bytes
from g4.exporters.formats import CARD_FILE, EVAL_FILE, FACTS_FILE, VERIFICATION_FILE
from g4.exporters.neuron_int8 import COMPILED_DIR, MANIFEST, Manifest

log = logging.getLogger(__name__)


# Files that mark a directory as a g4 result, which --overwrite may replace (their JSON
# has converter.name "g4" or a format starting with "g4-").
#: ``g4convert synth``'s marker: ``{"converter": {"name": "g4"}, "format": "g4-synthetic", "layers", "seed"}``;
#: a conversion of such a checkpoint says on its card that the weights are random.
SYNTH_MARKER = "g4_synth.json"
G4_OUTPUT_MARKERS = (HF_QUANT_CONFIG, MANIFEST, SYNTH_MARKER)


def _is_g4_output(path: Path) -> bool:
    for marker in G4_OUTPUT_MARKERS:
        try:
            data = json.loads((path / marker).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and (data.get("converter", {}).get("name") == "g4"
                                       or str(data.get("format", "")).startswith("g4-")):
            return True
    return False


# What g4 itself writes into a result, besides the safetensors files its index or manifest
# names and the side files (SIDE_FILE_PATTERNS): the converters' metadata, the model card and
# its facts (convert/card.py), g4serve check's report, g4convert eval's, and the Neuron compile cache
# (serve/neuron_backend.py) as a whole folder.
G4_RESULT_FILES = (INDEX_NAME, SINGLE_NAME, CONFIG_NAME, *G4_OUTPUT_MARKERS, FACTS_FILE, CARD_FILE,
                   VERIFICATION_FILE, EVAL_FILE)
G4_RESULT_FOLDERS = (COMPILED_DIR,)


def foreign_files(path: Path) -> list[str]:
    """Files under the g4 result ``path`` that g4 did not write (a user's notes, an evaluation
    folder, an empty folder: ``"name/"``), as paths relative to ``path``, sorted; --overwrite
    refuses to delete them.

    g4's own: :data:`G4_RESULT_FILES`, the side files copied from SRC, the safetensors files
    named by ``model.safetensors.index.json`` (``weight_map``) or ``manifest.json``
    (``rank_files``, ``host_embedding.file``), and whatever is under :data:`G4_RESULT_FOLDERS`.
    """
    named: set[str] = set()
    try:
        named |= {str(f) for f in json.loads((path / INDEX_NAME).read_text())["weight_map"].values()}
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        pass
    if (path / MANIFEST).is_file():
        try:
            manifest = Manifest.from_dir(path)
            named |= {*manifest.rank_files, manifest.host_embedding.get("file", "")}
        except CheckpointError:
            pass
    foreign = []
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path)
        if rel.parts[0] in G4_RESULT_FOLDERS:
            continue
        if f.is_dir() and not f.is_symlink():
            if not any(f.iterdir()):  # g4 writes no empty folder: a user made it
                foreign.append(rel.as_posix() + "/")
            continue
        name = rel.as_posix()
        if name in named or name in G4_RESULT_FILES or (len(rel.parts) == 1 and any(
                fnmatch.fnmatch(name, pat) for pat in SIDE_FILE_PATTERNS)):
            continue
        foreign.append(name)
    return foreign


def _not_replaceable(path: Path) -> str | None:
    """Why --overwrite may not replace ``path``, or None: it must be a real directory that is
    empty, or a g4 result holding nothing but what g4 wrote (:func:`foreign_files`)."""
    if path.is_symlink() or not path.is_dir():
        return "is not a directory"
    if not any(path.iterdir()):
        return None
    if not _is_g4_output(path):
        return ("exists and is not a g4 result; --overwrite only replaces g4 results (remove it yourself if you "
                "mean it)")
    foreign = foreign_files(path)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        return (f"holds {foreign[0]}{more}, which g4 did not write; --overwrite would delete it: move it out of OUT "
                "first")
    return None


def _replaceable(path: Path) -> bool:
    """What --overwrite may replace (see :func:`_not_replaceable`)."""
    return _not_replaceable(path) is None


# --- renames that never replace what they did not check (Linux renameat2(2)) ---
_AT_FDCWD, _RENAME_NOREPLACE, _RENAME_EXCHANGE = -100, 1, 2


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28, musl >= 1.2.3
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()  # None where missing: the callers below fall back


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags); False where libc, kernel or file system lack it.

    Raises:
        OSError: the rename failed (FileExistsError: ``dst`` exists, with RENAME_NOREPLACE).
    """
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # no such call, or the file system lacks the flag
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename directory ``src`` to ``dst`` unless something is at ``dst`` (that is never touched).

    Atomic with renameat2(RENAME_NOREPLACE). Without it, ``dst`` is first claimed with mkdir
    (which fails when anything is there) and ``src`` renamed onto that empty directory of ours:
    a plain rename would silently replace an empty directory someone else had just made.

    Raises:
        FileExistsError: something is at ``dst``.
        OSError: any other reason the rename failed.
    """
    if _rename2(src, dst, _RENAME_NOREPLACE):
        return
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError as e:
        with suppress(OSError):
            os.rmdir(dst)  # ours and empty; rmdir never removes what someone has put in it meanwhile
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(errno.EEXIST, "appeared meanwhile", str(dst)) from e
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock(path: Path, *, owner: int | None = None) -> int | None:
    """Open directory ``path`` and take an exclusive flock on it without waiting.

    A run holds the lock on its partial directory (and, with --overwrite, on the OUT it will
    replace) while it lives; the kernel drops it when the process dies, however it dies. So a
    lock that can be taken means no live run owns the directory, whatever its name's pid says
    (pids are reused, and differ between containers sharing a file system). On a file system
    without locks (some network mounts) the descriptor comes back unlocked, unless ``owner``
    (the pid in the directory's name) is a live process: then, as if locked, None.

    Returns:
        the open descriptor (close it to release), or None when a live process holds the lock.

    Raises:
        OSError: ``path`` cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL) or (
                owner is not None and _pid_alive(owner)):
            os.close(fd)
            if owner is None:
                raise
            return None
    return fd


@contextmanager
def _signals_held() -> Iterator[list[int]]:
    """Hold Ctrl-C and SIGTERM while directories are swapped, so a signal never lands between two
    renames and leaves OUT missing: the Python-level handlers are swapped for one that only
    records (a thread's signal mask is not enough: the C handler may run in any thread, and
    Python then runs the handler in the main thread regardless of its mask). Yields the list of
    signals that arrived; at the end the first one goes to the handler that was installed
    before (raising its KeyboardInterrupt), as if it had arrived just then."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield []
        return
    arrived: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield arrived
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if arrived:
            handler = before[arrived[0]]
            if callable(handler):
                handler(arrived[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(arrived[0])


def _not_writable(out: Path, e: OSError | None = None) -> str:
    """The message for an OUT whose parent directory cannot be written: it names the parent
    (where OUT and its temporary directory would go), never the temporary directory."""
    why = f" ({e.strerror or e})" if e is not None else ""
    return (f"{out.parent}: the parent directory of OUT is not writable{why}; g4 writes {out.name} there "
            "(through a temporary directory beside it): choose an OUT in a directory you can write")


def _new_partial(out: Path) -> tuple[Path, int]:
    """Create and lock ``.OUT.partial-<pid>-<random>`` beside ``out``: (path, lock descriptor)."""
    for _ in range(10):
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
        except (FileExistsError, FileNotFoundError):
            continue
        except OSError as e:  # read-only file system, or permissions os.access could not see (ACLs, root squash)
            raise ExportError(_not_writable(out, e)) from e
        try:
            fd = _lock(tmp)
        except (FileExistsError, FileNotFoundError):
            continue
        if fd is None:  # another run's clean-up took it for stale in the instant before our lock: try again
            continue
        try:
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise ExportError(f"{out.parent}: cannot create a temporary directory for OUT")


def _clean_up_after_killed_runs(out: Path) -> None:
    """Deal with what runs killed outright (SIGKILL, power loss) left beside ``out``, logging a
    line (warning) for each. Only g4's own names are looked at (exactly
    ``.OUT.partial-<pid>-<8 hex>`` and ``.OUT.old-<pid>-<8 hex>``; a user's ``.OUT.partial-mine``
    is never touched): a partial directory (an unfinished result) is removed; an ``old`` one (a
    g4 result that an --overwrite run without renameat2 had moved aside for the moment of the
    swap) is put back at ``out`` when ``out`` is missing, else removed, and only while it is
    still empty or a g4 result holding only g4's files. Directories a live run holds locked
    (:func:`_lock`) are skipped."""
    leftover = re.compile(rf"\.{re.escape(out.name)}\.(partial|old)-(\d+)-[0-9a-f]{{8}}")  # _new_partial, _place
    for p in sorted(out.parent.iterdir()):
        m = leftover.fullmatch(p.name)
        if m is None or p.is_symlink() or not p.is_dir():
            continue
        kind, pid = m.groups()
        try:
            fd = _lock(p, owner=int(pid))
        except OSError:
            continue
        if fd is None:
            continue
        try:
            if kind == "partial":
                shutil.rmtree(p, ignore_errors=True)
                log.warning("removed %s: the unfinished output of a g4 run that was killed", p)
            elif not _replaceable(p):
                continue  # not (only) a g4 result: never moved nor removed
            elif not os.path.lexists(out):
                _rename_noreplace(p, out)
                log.warning("restored %s from %s, where a killed g4 --overwrite run had moved it", out, p)
            else:
                shutil.rmtree(p, ignore_errors=True)
                log.warning("removed %s: the result a killed g4 --overwrite run had replaced", p)
        except OSError as e:
            log.warning("%s: left as it is (%s)", p, e.strerror or e)
        finally:
            os.close(fd)


def _keep_beside(tmp: Path, out: Path) -> Path:
    """Move the finished result from its hidden temporary name to ``OUT.new-<pid>`` (or
    ``OUT.new-<pid>-<n>``), which no clean-up ever removes; returns where it is."""
    for n in range(100):
        kept = out.with_name(f"{out.name}.new-{os.getpid()}" + (f"-{n}" if n else ""))
        try:
            _rename_noreplace(tmp, kept)
            return kept
        except FileExistsError:
            continue
    return tmp


def _place(tmp: Path, out: Path, held: int | None) -> str | None:
    """Rename the finished ``tmp`` to ``out``. ``held``: the locked descriptor of the directory
    that was at ``out`` at the start (validated then, --overwrite), else None.

    That directory is replaced only if it is still the one found at the start (same inode),
    still empty or a g4 result, checked on what was actually moved out of the way; anything else
    at ``out`` is left untouched. Returns None when placed, else what is wrong (``tmp`` is then
    still the finished result).
    """
    appeared = "appeared while this run was converting (another run, a user or a script made it)"
    if held is None or not os.path.lexists(out):
        try:
            _rename_noreplace(tmp, out)
        except FileExistsError:
            return appeared
        return None
    found = os.fstat(held)

    def still_ours(p: Path) -> bool:
        try:
            return os.path.samestat(os.stat(p, follow_symlinks=False), found) and _replaceable(p)
        except OSError:
            return False

    changed = "was replaced or changed while this run was converting and is not the g4 result --overwrite was given"
    if not still_ours(out):
        return changed
    if _rename2(tmp, out, _RENAME_EXCHANGE):  # atomic swap: out is never missing
        if still_ours(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        _rename2(tmp, out, _RENAME_EXCHANGE)  # swap back: never delete what was not checked
        return changed
    aside = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(out, aside)
    if not still_ours(aside):
        _rename_noreplace(aside, out)
        return changed
    try:
        _rename_noreplace(tmp, out)
    except FileExistsError:
        return f"{appeared}; the previous result is in {aside}"
    shutil.rmtree(aside, ignore_errors=True)
    return None


def refuse_existing(out: str | Path, overwrite: bool) -> None:
    """Refuse an existing ``out`` without ``overwrite``: the commands call this before SRC is
    resolved or read, and :func:`atomic_output_dir` again.

    Raises:
        ExportError: ``out`` exists (a file, a directory or a link) and ``overwrite`` is false.
    """
    out = Path(out).absolute()
    if os.path.lexists(out) and not overwrite:
        raise ExportError(f"{out}: already exists; choose another OUT or pass --overwrite")


def write_text_atomic(path: Path, text: str, *, placed: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path``, a file in OUT (a report, a model card, facts),
    atomically: a temporary ``.<name>.<random>`` beside it, mode 0644, renamed over ``path``; on
    any error or signal the temporary file is removed and ``path`` is as it was. ``placed``:
    recorded as complete (:func:`g4.core.errors.note_output_placed`), so a later Ctrl-C says it is
    kept. Returns ``path``.

    Raises:
        OSError: the directory cannot be written.
    """
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    if placed:
        note_output_placed(path)
    return path


@contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool = False, sources: Sequence[Path] = (),
                      need_bytes: int = 0) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; rename it to ``out`` only on success.

    On any exception the temporary directory is removed and an existing ``out`` is
    untouched. The final rename never replaces anything that was not checked: a directory
    that appears at ``out`` while the body runs (another run, a user) is left alone and the
    finished result is kept beside it as ``OUT.new-<pid>`` (named in the ExportError). With
    ``overwrite``, an existing ``out`` is replaced only after the new result is complete, only
    if it is empty or a previous g4 result, and only if it is still that same directory at the
    end (atomic swap, then the old one is deleted). Partial and set-aside directories of
    killed runs are cleaned up first (:func:`_clean_up_after_killed_runs`, one log line each).

    Args:
        sources: input directories; ``out`` may be neither one of them, nor inside one, nor
            contain one.
        need_bytes: bytes the result will take; refused up front if the file system of
            ``out`` has less free space (the old ``out`` is kept until the end, so it
            does not count as free).

    Raises:
        ExportError: ``out`` exists without ``overwrite``; ``out`` is, is inside or contains a
            source, or is or contains the working directory; ``out`` exists, is not empty and is
            not a g4 result; another run is replacing it; its parent is missing or not writable; not enough free
            disk space; at the end, ``out`` appeared or changed meanwhile (result kept beside).
    """
    out = Path(out).absolute()
    resolved = out.resolve()
    guarded = [(f"SRC {Path(s).resolve()}", Path(s).resolve()) for s in sources]
    for what, path in [*guarded, ("the working directory", Path.cwd().resolve())]:
        if path == resolved or resolved in path.parents:
            raise ExportError(f"{out}: OUT would replace {what}; choose another OUT")
    for what, path in guarded:
        if path in resolved.parents:
            raise ExportError(f"{out}: OUT is inside {what} and would be written into it; choose an OUT outside it")
    if out.is_symlink():
        raise ExportError(f"{out}: is a symbolic link (to {out.resolve()}); give the real path as OUT")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent}: parent directory of OUT does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):  # before the temporary directory is named in any error
        raise ExportError(_not_writable(out))
    _clean_up_after_killed_runs(out)
    refuse_existing(out, overwrite)
    why = _not_replaceable(out) if os.path.lexists(out) else None
    if why:
        raise ExportError(f"{out}: {why}")
    free = shutil.disk_usage(out.parent).free
    if need_bytes > free:
        raise ExportError(f"{out.parent}: {format_bytes(free)} free, the result needs {format_bytes(need_bytes)}")
    held = _lock(out) if os.path.lexists(out) else None
    if os.path.lexists(out) and held is None:
        raise ExportError(f"{out}: another g4 run is replacing it; wait for that run to finish")
    try:
        tmp, tmp_lock = _new_partial(out)
        try:
            try:
                yield tmp
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise ExportError(f"{out}: cannot write the result: {e.strerror or e}") from e
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            with _signals_held() as arrived:
                if arrived or signal_received() is not None:  # raised (again) as the block ends
                    shutil.rmtree(tmp, ignore_errors=True)
                    problem = kept = None
                else:
                    try:
                        problem = _place(tmp, out, held)
                    except OSError as e:
                        problem = f"cannot be replaced ({e.strerror or e})"
                    kept = _keep_beside(tmp, out) if problem else None
                    if not problem:
                        note_output_placed(out)
            raise_if_signalled()  # a signal whose exception something swallowed: OUT was not placed
        finally:
            os.close(tmp_lock)
    finally:
        if held is not None:
            os.close(held)
    if problem:
        raise ExportError(f"{out}: {problem}; it was left untouched and the finished result is in {kept}")
