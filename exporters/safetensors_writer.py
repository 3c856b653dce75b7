"""Streaming sharded safetensors output, planned before any data is produced.

The shard layout is computed from the list of output tensors (name, dtype, shape) in
production order, so each shard's header and every tensor's place are known first and tensor
bytes are written at their places as they are produced (by one thread or several): host RAM
holds the tensors being written, never a shard.

File format: huggingface/safetensors ``docs/source/index.mdx`` (8-byte little-endian
header length, JSON header with ``dtype``/``shape``/``data_offsets``, then raw
little-endian data). Index format: transformers' ``model.safetensors.index.json``
(``metadata.total_size`` in bytes plus ``weight_map``).

Where the shards go: :func:`g4.exporters.output_dir.atomic_output_dir` (a temporary folder
renamed into place when complete).

How the bytes go: the whole 4 KiB blocks of each tensor with direct I/O (``O_DIRECT``) from a reused
page-aligned buffer, the rest through the page cache (:data:`DIRECT_BLOCK`, ``G4_DIRECT_WRITE=0`` to turn
it off); read small tensors of a result back with ``Checkpoint.read``, not its mmap.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import threading
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.core.checkpoint import DTYPE_TO_ST, INDEX_NAME, SINGLE_NAME
from g4.core.errors import ExportError


# Direct I/O (``O_DIRECT``) for the tensor bytes :meth:`ShardedSafetensorsWriter.put` writes:
# every whole 4 KiB block inside one put goes from a reused page-aligned buffer straight to the
# disk; the partial blocks at a put's two ends, the headers and copy_in's kernel copies go through
# the page cache, so no block is ever written both ways. Measured 2026-12-04 on this VM (dd, 16 MiB
# blocks): new file data 0.43 GB/s buffered, 1.9-2.7 GB/s direct, because each new page-cache page
# is first touched from the host; on any machine the output then takes no page cache (a 26 GB
# int8 result on a 16 GiB host no longer competes with the source for it). G4_DIRECT_WRITE=0, or a
# file system that refuses O_DIRECT (tmpfs, some FUSE), writes everything through the page cache:
# the same bytes.
DIRECT_BLOCK = 4096
DIRECT_ENV = "G4_DIRECT_WRITE"


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
        self._slots = {spec.name: i for i, (_, _, spec) in enumerate(self._order)}  # claim_early's lookup
        self._early: set[int] = set()
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._written = 0
        self._local = threading.local()  # per-thread staging buffer for views (put)
        self._direct_fds: dict[int, int | None] = {}  # shard -> O_DIRECT descriptor (None: refused)
        self._direct = os.environ.get(DIRECT_ENV, "") != "0" and hasattr(os, "O_DIRECT")
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
        slot = self._slots.get(name)  # not a scan of the plan per call: quadratic in the tensors
        if slot is None or slot < self._next or slot in self._early:
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
        direct_fd = self._direct_fd(shard_idx) if total >= 2 * DIRECT_BLOCK else None
        out = _BlockWriter(fd, direct_fd, offset, self._aligned_buffer() if direct_fd is not None else None)
        if tensor.is_contiguous() or tensor.dim() == 0:
            data = _bytes_of(tensor)
            for b0 in range(0, len(data), COPY_CHUNK_BYTES):  # 16 MiB writes: one huge write() was 2-3x slower (bench)
                out.write(data[b0 : b0 + COPY_CHUNK_BYTES])
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
                out.write(_bytes_of(staged))
        if not out.finish():  # the file system refused O_DIRECT: the page cache from now on
            with self._lock:
                self._direct_fds[shard_idx] = None
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

    def _direct_fd(self, shard_idx: int) -> int | None:
        """A second descriptor of the shard's file opened with ``O_DIRECT`` (after :meth:`_fd`
        created it), or None: direct writes off, or refused by the file system."""
        if not self._direct:
            return None
        with self._lock:
            if shard_idx not in self._direct_fds:
                try:
                    self._direct_fds[shard_idx] = os.open(self.out_dir / self.files[shard_idx],
                                                          os.O_WRONLY | os.O_DIRECT)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._direct_fds[shard_idx] = None
            return self._direct_fds[shard_idx]

    def _aligned_buffer(self) -> mmap.mmap:
        """This thread's page-aligned :data:`COPY_CHUNK_BYTES` buffer for direct writes (reused)."""
        buf = getattr(self._local, "aligned", None)
        if buf is None:
            buf = self._local.aligned = mmap.mmap(-1, COPY_CHUNK_BYTES)
        return buf

    def __del__(self):  # an abandoned writer (an error before close) does not keep its files open
        for fd in [*getattr(self, "_fds", {}).values(), *(d for d in getattr(self, "_direct_fds", {}).values() if d)]:
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
                fds += [d for d in self._direct_fds.values() if d is not None]
                self._direct_fds = {}
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


class _BlockWriter:
    """The bytes of one put, in order, at ``offset`` of a file: with a direct descriptor, every
    whole :data:`DIRECT_BLOCK` block gathered in the page-aligned ``buf`` and written with
    ``O_DIRECT``, the partial blocks at both ends through ``fd`` (the page cache); without one,
    all through ``fd``. :meth:`finish` writes what is left and returns False if the file system
    refused a direct write (EINVAL), after writing those bytes through ``fd``."""

    def __init__(self, fd: int, direct_fd: int | None, offset: int, buf: mmap.mmap | None):
        self.fd, self.direct_fd, self.at = fd, direct_fd, offset
        self.view, self.filled, self.ok = memoryview(buf) if buf is not None else None, 0, True

    def write(self, data: memoryview) -> None:
        if self.direct_fd is None:
            _pwrite_all(self.fd, data, self.at)
            self.at += len(data)
            return
        if self.filled == 0 and self.at % DIRECT_BLOCK:  # the partial block before the first boundary
            head = min(len(data), DIRECT_BLOCK - self.at % DIRECT_BLOCK)
            _pwrite_all(self.fd, data[:head], self.at)
            self.at, data = self.at + head, data[head:]
        while len(data):
            n = min(len(data), len(self.view) - self.filled)
            self.view[self.filled : self.filled + n] = data[:n]
            self.filled, data = self.filled + n, data[n:]
            if self.filled == len(self.view):
                self._flush(self.filled)

    def _flush(self, nbytes: int) -> None:
        """Write the first ``nbytes`` (whole blocks) of the buffer at ``self.at``."""
        if nbytes:
            if self.ok:
                try:
                    done = 0
                    while done < nbytes:
                        done += os.pwrite(self.direct_fd, self.view[done:nbytes], self.at + done)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.ok = False
            if not self.ok:
                _pwrite_all(self.fd, self.view[:nbytes], self.at)
        self.at += nbytes
        rest = self.filled - nbytes
        if rest:
            self.view[:rest] = self.view[nbytes : self.filled]
        self.filled = rest

    def finish(self) -> bool:
        if self.direct_fd is not None:
            whole = self.filled - self.filled % DIRECT_BLOCK
            self._flush(whole)
            if self.filled:  # the partial block after the last boundary
                _pwrite_all(self.fd, self.view[: self.filled], self.at)
                self.at += self.filled
                self.filled = 0
        return self.ok
