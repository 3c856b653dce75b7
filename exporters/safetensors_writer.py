"""Streaming sharded safetensors output, planned before any data is produced.

The shard layout is computed from the list of output tensors (name, dtype, shape) in
production order, so each shard's header and every tensor's place are known first and tensor
bytes are written at their places as they are produced (by one thread or several): host RAM
holds the tensors being written, never a shard.

File format: huggingface/safetensors ``docs/source/index.mdx`` (8-byte little-endian
header length, JSON header with ``dtype``/``shape``/``data_offsets``, then raw
little-endian data). Index format: transformers' ``model.safetensors.index.json``
(``metadata.total_size`` in bytes plus ``weight_map``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import fnmatch
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.convert.checkpoint import DTYPE_TO_ST, INDEX_NAME, SIDE_FILE_PATTERNS, SINGLE_NAME
from g4.convert.errors import ExportError, OptionError, note_output_placed, raise_if_signalled, signal_received
from g4.exporters.model_card import EVAL_FILE

log = logging.getLogger(__name__)

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def format_bytes(n: int | float) -> str:
    """``n`` bytes in the largest decimal unit it reaches (GB = 10**9 bytes, MB, kB), three
    decimals, or whole bytes below 1 kB: ``"3.547 GB"``, ``"1.000 kB"``, ``"512 B"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``"5GB"`` is 5*10**9 (decimal), ``"5GiB"`` is 5*2**30 (binary).

    An int is a number of bytes; a string needs its unit (``"80"`` is refused, not taken
    as 80 bytes; ``"80B"`` is 80 bytes).

    Raises:
        OptionError: not a positive number with one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).upper() if m else None
        if not m or (unit and unit not in _SIZE_UNITS):
            raise OptionError(f"cannot parse size {text!r}: use e.g. 5GB (10**9 bytes) or 4GiB (2**30 bytes)")
        value = int(float(m.group(1)) * _SIZE_UNITS.get(unit, 1))
        if value > 0 and not unit:
            raise OptionError(f"size {text!r} has no unit: write e.g. {m.group(1)}GB (10**9 bytes), "
                             f"{m.group(1)}GiB (2**30 bytes) or {m.group(1)}B (bytes)")
    if value <= 0:
        raise OptionError(f"size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """An output tensor announced before it is produced."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# Bytes per file write, and of a non-contiguous tensor copied per write (ShardedSafetensorsWriter.write).
COPY_CHUNK_BYTES = 16 << 20


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of contiguous CPU tensor ``t`` (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` of data each.

    A tensor larger than the limit gets a shard of its own (as transformers does).

    Raises:
        ExportError: duplicate tensor names.
    """
    seen: set[str] = set()
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if spec.name in seen:
            raise ExportError(f"output tensor {spec.name} is produced twice")
        seen.add(spec.name)
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


def shard_file_names(n: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000i-of-0000n.safetensors``."""
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _header_bytes(shard: Sequence[TensorSpec]) -> bytes:
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        header[spec.name] = {"dtype": DTYPE_TO_ST[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class ShardedSafetensorsWriter:
    """Write planned tensors, in plan order, into sharded safetensors files.

    Either ``max_shard_bytes`` (shards ``model-0000i-of-0000n.safetensors`` plus an index)
    or ``file_name`` (everything in that one file) is given.

    Usage::

        writer = ShardedSafetensorsWriter(out_dir, specs, max_shard_bytes=5 * 10**9)
        for spec in specs:
            writer.write(spec.name, produce(spec))
        writer.close()   # checks nothing is missing, writes model.safetensors.index.json

    Raises:
        ExportError: a tensor written out of order, or whose dtype/shape differs from
            its spec; ``close()`` before every tensor was written.
    """

    def __init__(self, out_dir: Path, specs: Sequence[TensorSpec], *, max_shard_bytes: int | None = None,
                 file_name: str | None = None, index_metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        if file_name is not None:  # one named file, no index (e.g. tp0_sharded_checkpoint.safetensors)
            self.shards = plan_shards(specs, max_shard_bytes=2**63)
            self.files = [file_name]
        else:
            self.shards = plan_shards(specs, max_shard_bytes)
            self.files = shard_file_names(len(self.shards))
        self._headers = [_header_bytes(shard) for shard in self.shards]
        # (shard, byte offset in its file, spec) of every tensor, in plan order
        self._order: list[tuple[int, int, TensorSpec]] = []
        for i, shard in enumerate(self.shards):
            offset = len(self._headers[i])
            for spec in shard:
                self._order.append((i, offset, spec))
                offset += spec.nbytes
        self._next = 0
        self._early: set[int] = set()
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._written = 0
        self._local = threading.local()  # per-thread staging buffer for views (put)
        self.total_bytes = sum(spec.nbytes for _, _, spec in self._order)
        self._index_metadata = dict(index_metadata or {})

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (a CPU tensor of the planned dtype and shape) as the next planned
        tensor: :meth:`claim` then :meth:`put`."""
        self.put(self.claim(name, tensor), tensor)

    def claim(self, name: str, tensor: torch.Tensor) -> int:
        """Check that ``tensor`` is the next planned tensor (name, dtype, shape) and take its
        place in the files; returns the slot to :meth:`put` it into. Claims come in plan order
        (one thread); puts may then come from any thread, in any order.

        Raises:
            ExportError: not planned, out of order, or another dtype/shape than planned.
        """
        while self._next in self._early:  # taken out of order by claim_early
            self._next += 1
        if self._next >= len(self._order):
            raise ExportError(f"output tensor {name} was not planned")
        spec = self._order[self._next][2]
        if name != spec.name:
            raise ExportError(f"output tensor {name} written out of order; expected {spec.name}")
        _check_planned(spec, tensor.dtype, tensor.shape)
        self._next += 1
        return self._next - 1

    def claim_early(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        """Take the place of planned tensor ``name`` (of ``dtype`` and ``shape``) ahead of its turn,
        e.g. to :meth:`copy_in` it from the source while earlier tensors are still being produced;
        :meth:`claim` then passes over it. Returns its slot.

        Raises:
            ExportError: not planned, already claimed, or another dtype/shape than planned.
        """
        slot = next((i for i in range(self._next, len(self._order)) if self._order[i][2].name == name), None)
        if slot is None or slot in self._early:
            raise ExportError(f"output tensor {name} was not planned or is already claimed")
        _check_planned(self._order[slot][2], dtype, shape)
        self._early.add(slot)
        return slot

    def copy_in(self, slot: int, src: Path, src_offset: int, first_byte: int = 0, nbytes: int | None = None) -> None:
        """Write bytes ``[first_byte, first_byte + nbytes)`` of the tensor of ``slot`` (default:
        all of it) from file ``src`` at ``src_offset + first_byte``, copied by the kernel
        (``os.copy_file_range``: no copy through this process's memory); thread-safe as
        :meth:`put`. For a tensor kept exactly as its source stored it.

        Raises:
            OSError: a file cannot be read or written, or ``src`` ends early.
        """
        shard_idx, offset, spec = self._order[slot]
        nbytes = spec.nbytes - first_byte if nbytes is None else nbytes
        fd = self._fd(shard_idx)
        src_at, dst_at = src_offset + first_byte, offset + first_byte
        with open(src, "rb", buffering=0) as f:
            done = 0
            while done < nbytes:
                n = _copy_range(f.fileno(), fd, nbytes - done, src_at + done, dst_at + done)
                if n == 0:
                    raise OSError(errno.EIO, f"{src}: ends before the tensor's data")
                done += n
        with self._lock:
            self._written += nbytes

    def put(self, slot: int, tensor: torch.Tensor, first_row: int = 0) -> None:
        """Write ``tensor`` at the place of ``slot`` (from :meth:`claim`); thread-safe, so several
        threads can write different tensors, or different rows of one, at once.

        Args:
            slot: from :meth:`claim`.
            tensor: the claimed tensor, or rows ``[first_row, first_row + len(tensor))`` of its
                first dimension (``claimed[first_row:first_row + n]``).
            first_row: index of ``tensor``'s first row in the claimed tensor.

        A contiguous tensor is written from its own memory; a view that is not contiguous (a
        rank's column slice, a transpose) is copied a few rows at a time through a reused
        per-thread buffer: the same bytes as ``tensor.contiguous()``, without a second copy of
        the tensor in RAM. Every write is at most :data:`COPY_CHUNK_BYTES`.

        Raises:
            OSError: the file cannot be created or written.
        """
        shard_idx, offset, _ = self._order[slot]
        fd = self._fd(shard_idx)
        tensor = tensor.detach()
        total = tensor.numel() * tensor.element_size()
        if first_row:
            offset += first_row * tensor[0].numel() * tensor.element_size()
        if tensor.is_contiguous() or tensor.dim() == 0:
            data = _bytes_of(tensor)
            for b0 in range(0, len(data), COPY_CHUNK_BYTES):  # 16 MiB writes: one huge write() was 2-3x slower (bench)
                _pwrite_all(fd, data[b0 : b0 + COPY_CHUNK_BYTES], offset + b0)
        else:  # a view (a rank's slice, a transpose): copied a few rows at a time, never whole
            row_bytes = max(tensor[0].numel() * tensor.element_size(), 1)
            rows = max(1, COPY_CHUNK_BYTES // row_bytes)
            staging = getattr(self._local, "staging", None)
            for r0 in range(0, tensor.shape[0], rows):
                part = tensor[r0 : r0 + rows]
                n = part.numel() * part.element_size()
                if staging is None or staging.numel() < n:
                    staging = self._local.staging = torch.empty(max(COPY_CHUNK_BYTES, row_bytes), dtype=torch.uint8)
                staged = staging[:n].view(part.dtype).view(part.shape)
                staged.copy_(part)
                _pwrite_all(fd, _bytes_of(staged), offset)
                offset += n
        with self._lock:
            self._written += total

    def _fd(self, shard_idx: int) -> int:
        """The shard's file, created (header written) on first use."""
        with self._lock:
            fd = self._fds.get(shard_idx)
            if fd is None:
                fd = os.open(self.out_dir / self.files[shard_idx], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
                self._fds[shard_idx] = fd
                _pwrite_all(fd, memoryview(self._headers[shard_idx]), 0)
            return fd

    def __del__(self):  # an abandoned writer (an error before close) does not keep its files open
        for fd in getattr(self, "_fds", {}).values():
            with suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Close the files and write the index (when there is more than one shard).

        Raises:
            ExportError: a planned tensor was not written.
        """
        try:
            while self._next in self._early:
                self._next += 1
            if self._next != len(self._order):
                missing = self._order[self._next][2].name
                raise ExportError(f"output incomplete: tensor {missing} and {len(self._order) - self._next - 1} "
                                  "more not written")
            if self._written != self.total_bytes:
                raise ExportError(f"output incomplete: {self.total_bytes - self._written} bytes of claimed tensors "
                                  "not written")
            for i in range(len(self.shards)):  # a shard of empty tensors only gets its header too
                self._fd(i)
        finally:
            with self._lock:
                fds, self._fds = list(self._fds.values()), {}
            for fd in fds:
                os.close(fd)
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total_bytes, **self._index_metadata},
                "weight_map": {spec.name: self.files[i] for i, _, spec in self._order},
            }
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _check_planned(spec: TensorSpec, dtype: torch.dtype, shape) -> None:
    if dtype != spec.dtype or tuple(shape) != spec.shape:
        raise ExportError(f"output tensor {spec.name} is {dtype} {list(shape)}, planned {spec.dtype} {list(spec.shape)}")


_NO_COPY_RANGE = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _copy_range(src_fd: int, dst_fd: int, nbytes: int, src_at: int, dst_at: int) -> int:
    """Copy up to ``nbytes`` from ``src_fd`` at ``src_at`` to ``dst_fd`` at ``dst_at``; bytes
    copied (0 at the end of the source). ``os.copy_file_range`` where the OS and file systems
    have it (Linux), else a read and a positioned write of at most :data:`COPY_CHUNK_BYTES`."""
    if hasattr(os, "copy_file_range"):
        try:
            return os.copy_file_range(src_fd, dst_fd, nbytes, src_at, dst_at)
        except OSError as e:
            if e.errno not in _NO_COPY_RANGE:
                raise
    data = os.pread(src_fd, min(nbytes, COPY_CHUNK_BYTES), src_at)
    _pwrite_all(dst_fd, memoryview(data), dst_at)
    return len(data)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``data`` is at ``offset`` (a short write continues)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


# Files that mark a directory as a g4 result, which --overwrite may replace (their JSON
# has converter.name "g4" or a format starting with "g4-").
#: ``g4convert synth``'s marker: ``{"converter": {"name": "g4"}, "format": "g4-synthetic", "layers", "seed"}``;
#: a conversion of such a checkpoint says on its card that the weights are random.
SYNTH_MARKER = "g4_synth.json"
G4_OUTPUT_MARKERS = ("hf_quant_config.json", "manifest.json", SYNTH_MARKER)  # neuron_int8.MANIFEST


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
# its facts (exporters/model_card.py), g4serve check's report, g4convert eval's, and the Neuron compile cache
# (serve/neuron_backend.py) as a whole folder.
G4_RESULT_FILES = (INDEX_NAME, SINGLE_NAME, "config.json", *G4_OUTPUT_MARKERS, "g4_conversion.json", "README.md",
                   "verification.json", EVAL_FILE)
G4_RESULT_FOLDERS = ("neuron_compiled",)


def foreign_files(path: Path) -> list[str]:
    """Files under the g4 result ``path`` that g4 did not write (a user's notes, an evaluation
    folder, an empty folder: ``"name/"``), as paths relative to ``path``, sorted; --overwrite
    refuses to delete them.

    g4's own: :data:`G4_RESULT_FILES`, the side files copied from SRC, the safetensors files
    named by ``model.safetensors.index.json`` (``weight_map``) or ``manifest.json``
    (``rank_files``, ``host_embedding.file``), and whatever is under :data:`G4_RESULT_FOLDERS`.
    """
    from g4.convert.errors import CheckpointError
    from g4.exporters.neuron_int8 import MANIFEST, Manifest  # it imports this module

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
    if os.path.lexists(out) and not overwrite:
        raise ExportError(f"{out}: already exists; choose another OUT or pass --overwrite")
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
