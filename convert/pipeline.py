"""Overlap of reading, quantizing and writing in the conversions (threads: torch and file
I/O release the GIL).

- :class:`Prefetcher` reads source tensors in the order they will be asked for, in a
  background thread, at most ``budget_bytes`` ahead of the consumer, with the disk asked for the
  next :data:`DISK_AHEAD_BYTES` of them before they are read (:class:`DiskReadahead`);
- :class:`BackgroundWriter` writes tensors into their ``ShardedSafetensorsWriter`` in
  background threads, each at its planned place, at most ``budget_bytes`` behind;
- :class:`BackgroundHashes` hashes the source files while the conversion runs, each byte the
  conversion reads hashed only once the conversion has read it, so both use the same pages and
  the source is read from the disk once;
- :class:`SourceRelease` drops the source's pages from the page cache once every reader is done
  with them (a 51.6 GB source then does not fill the page cache with pages nobody reads again);
- :func:`overlapped` runs a layer loop with the first two.

The reader keeps the order of the reads; the writer claims each tensor's place in the order
it was queued (names, dtypes and shapes checked then), so the files are the same bytes as a
sequential run, whichever thread writes which piece when. An exception in a thread is raised again in the caller at its
next call, or at :meth:`close`.
"""

from __future__ import annotations

import bisect
import copy
import functools
import hashlib
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from g4.core.checkpoint import Checkpoint, finite_amax
from g4.core.errors import CheckpointError

# Bytes of small source tensors read ahead beyond the next one (Prefetcher), and of outputs
# queued for the writer thread (BackgroundWriter), in the conversions' layer loops.
READ_AHEAD_BYTES = 64 << 20
# Bytes of source tensors the kernel is asked to read from the disk ahead of the Prefetcher
# (DiskReadahead: posix_fadvise WILLNEED), so a cold source streams with large reads in flight
# instead of the page-fault-sized ones its mmap makes; the pages wait in the page cache.
# Tried instead and not kept (2026-12-06, cold 2-layer synthetic, nvfp4 --weight-only, A/B
# alternated): the tensors of 4 MiB and more read with O_DIRECT by a thread of their own, the
# same 512 MiB ahead, into page-aligned buffers reused once the consumer had dropped each tensor,
# and the writer's copies of kept tensors read the same way: 5.02 / 4.34 s per layer against
# 4.07 / 4.30 through the page cache (sys 4.2 / 3.0 against 4.0 / 4.6 s), peak RSS 2.75 GiB
# against 2.1-2.4; only the copies so: 4.89 / 4.86 against 4.60 / 4.39. The conversion is bound
# by its quantization on 2 cores, not by the reads. Nor kept: an expert tensor handed out before
# its amax pass, expert e quantized as soon as its amax was known (4.90 / 4.86 / 5.07 s against
# 4.42 / 5.06 / 4.43; with one torch thread 5.8-6.5); the same CPU-seconds of identical runs
# varied by 45% over the hour, more than any of these differences.
DISK_AHEAD_BYTES = 512 << 20
WRITE_BEHIND_BYTES = 256 << 20
# Seconds the Prefetcher's thread waits for room before it releases (SourceRelease.sweep) what
# the consumer has dropped meanwhile, and waits again.
_SWEEP_SECONDS = 0.05
# Threads hashing the source files (BackgroundHashes), a file each: with one, the hash of a
# cold 10-layer synthetic 26B-A4B (19 GB in 4 files) fell behind the int8-neuron conversion it
# is paced by (its share of 2 cores beside the quantization and the I/O threads) and the
# conversion then waited 7-12 s for it at the end (bench/bench_convert.py).
HASH_THREADS = 2
# Threads writing the outputs (BackgroundWriter): two wrote new file data about 3x faster than
# one on the 2-core machine here (bench/bench_convert.py measures its I/O floor the same way).
WRITE_THREADS = 2
# Rows of a larger tensor are queued in pieces of about this many bytes, so both threads write it.
WRITE_PIECE_BYTES = 64 << 20


class _ByteBudget:
    """A FIFO of items with blocking put while more than ``budget`` bytes wait, or are held
    by a taker until :meth:`release` (one item larger than the budget is let through alone)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.items: deque = deque()
        self.bytes = 0  # queued, and held by a taker (put(held=True)) until released
        self.done = False
        self.error: BaseException | None = None
        self.cv = threading.Condition()

    def wait_room(self, nbytes: int, timeout: float | None = None) -> bool:
        """Block until ``nbytes`` more fit (or nothing waits, nor is held, or an error came), at
        most ``timeout`` seconds; whether they do."""
        with self.cv:
            return self.cv.wait_for(lambda: self.error is not None or self.bytes == 0
                                    or self.bytes + nbytes <= self.budget, timeout)

    def put(self, item, nbytes: int, *, held: bool = False) -> None:
        """Queue ``item`` of ``nbytes`` once they fit. ``held``: its bytes count until
        :meth:`release` (the taker is still using them), not only until :meth:`take`."""
        self.wait_room(nbytes)
        with self.cv:
            self.items.append((item, nbytes, held))
            self.bytes += nbytes
            self.cv.notify_all()

    def take(self):
        """The oldest item, or None once ``done`` and empty; the error of :meth:`fail` once the
        items queued before it are taken (they were good)."""
        with self.cv:
            self.cv.wait_for(lambda: self.items or self.done or self.error is not None)
            if not self.items:
                if self.error is not None:
                    raise self.error
                return None
            item, nbytes, held = self.items.popleft()
            self.bytes -= 0 if held else nbytes
            self.cv.notify_all()
            return item

    def release(self, nbytes: int) -> None:
        """A held item's bytes are done with."""
        with self.cv:
            self.bytes -= nbytes
            self.cv.notify_all()

    def fail(self, e: BaseException) -> None:
        with self.cv:
            self.error = e
            self.cv.notify_all()

    def finish(self) -> None:
        with self.cv:
            self.done = True
            self.cv.notify_all()


class FileAdvice:
    """``posix_fadvise`` on byte ranges of source files, one read-only descriptor per file kept
    open until :meth:`close`; advice only, so an OSError is ignored (the read itself reports a
    real problem), and without ``posix_fadvise`` (not Linux/POSIX) nothing is done."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # any thread may advise
        self.on = hasattr(os, "posix_fadvise")

    def advise(self, path: "str | os.PathLike[str]", offset: int, nbytes: int, advice: int) -> bool:
        """Give ``advice`` for ``nbytes`` at ``offset`` of ``path``; whether it was given."""
        if not self.on or nbytes <= 0:
            return False
        try:
            with self._lock:
                fd = self._fds.get(str(path))
                if fd is None:
                    fd = self._fds[str(path)] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, offset, nbytes, advice)
            return True
        except OSError:
            return False

    def willneed(self, path: "str | os.PathLike[str]", offset: int, nbytes: int,
                 stop: Callable[[], bool] | None = None) -> None:
        """``POSIX_FADV_WILLNEED`` on ``nbytes`` at ``offset`` of ``path``, in pieces of
        :func:`readahead_piece_bytes`: Linux reads at most the device's readahead window per
        call (``force_page_cache_ra`` in ``mm/readahead.c`` caps it at the larger of the
        backing device's ``read_ahead_kb`` and ``max_sectors_kb``), so one call on a 1 GiB
        tensor read 8 MiB of it here, and 128 calls of 8 MiB read all of it in 0.2 s of calls."""
        piece = readahead_piece_bytes(path)
        end = offset + nbytes
        while (offset < end and not (stop is not None and stop())
               and self.advise(path, offset, min(piece, end - offset), os.POSIX_FADV_WILLNEED)):
            offset += piece

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def readahead_piece_bytes(path: "str | os.PathLike[str]") -> int:
    """Bytes one ``POSIX_FADV_WILLNEED`` call reads of a file on ``path``'s file system: its
    backing device's readahead window (``/sys/class/bdi/MAJOR:MINOR/read_ahead_kb``, KiB),
    at least 128 KiB (the kernel's default window, also used when sysfs does not say)."""
    try:
        return _readahead_window_bytes(os.stat(path).st_dev)
    except OSError:
        return 128 << 10


@functools.cache
def _readahead_window_bytes(dev: int) -> int:
    try:
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
            kib = int(f.read().strip())
    except (OSError, ValueError):
        kib = 0
    return max(kib, 128) << 10


class DiskReadahead:
    """Asks the kernel to read source tensors from the disk before they are read
    (``posix_fadvise(fd, offset, nbytes, POSIX_FADV_WILLNEED)`` on each tensor's byte range, in
    pieces of the device's readahead window, :meth:`FileAdvice.willneed`: asynchronous
    readahead into the page cache, many reads in flight, without mapping), keeping the tensors
    from the one being read up to ``ahead_bytes`` beyond it asked for. The asking is done by a
    thread of its own: a ``WILLNEED`` call blocks while the disk's queue is full, and asked from
    the reading thread, the 512 MiB beyond the tensor being read held up the read of that tensor
    (a cold 10-layer int8-neuron conversion's reader spent 12 of its 31 s in these calls while the
    layer loop waited 9 s for it). Without ``posix_fadvise`` (not Linux/POSIX) it does nothing.

    Args:
        ckpt: the source (its :class:`~g4.core.checkpoint.TensorInfo` paths and offsets).
        names: the tensors, in the order they will be read.
        ahead_bytes: bytes asked for beyond the current tensor, at most (at least the next one).
    """

    def __init__(self, ckpt: Checkpoint, names: Sequence[str], ahead_bytes: int = DISK_AHEAD_BYTES):
        self._infos = [ckpt.tensors[n] for n in names]
        self._ahead = ahead_bytes
        self._files = FileAdvice()
        self._cv = threading.Condition()
        self._reading = -1  # the tensor being read (none yet)
        self._next = 0  # first tensor not yet asked for
        self._asked = 0  # bytes asked for from tensor `_reading` on
        self._closed = False
        self._thread = None
        if self._files.on:
            self._thread = threading.Thread(target=self._run, name="g4-readahead", daemon=True)
            self._thread.start()

    def _wanted(self) -> bool:
        """Whether tensor ``_next`` is to be asked for now (the lock held)."""
        return (0 <= self._reading and self._next < len(self._infos)
                and (self._next <= self._reading + 1 or self._asked < self._ahead))

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._wanted())
                if self._closed:
                    return
                k = self._next
                info = self._infos[k]
            self._files.willneed(info.path, info.offset, info.nbytes, stop=lambda: self._closed)
            with self._cv:
                if self._next == k:  # not skipped by reading() meanwhile
                    self._next, self._asked = k + 1, self._asked + info.nbytes
                self._cv.notify_all()

    def reading(self, i: int) -> None:
        """Tensor ``i`` (of ``names``) is read now: returns once it has been asked for; the ones
        after it are asked for in the background, up to the budget."""
        if self._thread is None:
            return
        with self._cv:
            if i > self._reading:
                for j in range(max(self._reading, 0), min(i, self._next)):
                    self._asked -= self._infos[j].nbytes
                self._reading = i
                if self._next <= i:  # behind the reads: skip what is read already
                    self._next, self._asked = i, 0
                self._cv.notify_all()
            self._cv.wait_for(lambda: self._closed or self._next > i)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Block until every tensor the budget allows beyond the one being read has been asked
        for (at most ``timeout`` seconds; for tests and benches)."""
        with self._cv:
            self._cv.wait_for(lambda: self._closed or not self._wanted(), timeout)

    def close(self) -> None:
        """Stop asking (at the next piece), wait for the thread, close the file descriptors it
        opened (pages already asked for stay in the page cache)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._files.close()


class SourceRelease:
    """Releases source byte ranges from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``)
    once every reader is done with them: the conversion (:meth:`consumed`: a tensor the
    :class:`Prefetcher` handed out, once the consumer has dropped it; a range the
    :class:`BackgroundWriter` copied) and, with ``hashed``, the source hash (:meth:`hashed_to`,
    from :class:`BackgroundHashes`, which reads each file in order). The advice is given at the
    next :meth:`sweep` (the Prefetcher sweeps before each read, :meth:`close` at the end), when
    the dropped tensor's mapping is gone: the kernel keeps pages still mapped, which is correct,
    only not released. It also paces the hash (:meth:`wait_hash_room`): a byte the conversion
    will read (:meth:`plan`) is hashed only once it has been read (:meth:`read`), so the hash
    finds it in the page cache instead of reading it from the disk again (a hash paced only by
    the bytes consumed lagged behind in file order, and in a 6 GiB memory cgroup the 10-layer
    synthetic was read 1.82x); bytes nobody plans to read are hashed at once. The source is never
    changed: the advice only frees clean page cache. Without ``posix_fadvise`` nothing is
    released (the hash is still paced).

    Attributes:
        released_bytes: bytes of consumed ranges advised DONTNEED so far.
    """

    def __init__(self, *, hashed: bool = False):
        self._hashed = hashed
        self._hashed_to: dict[str, int] = {}  # path -> bytes of it hashed, from offset 0
        self._ready: deque = deque()  # (path, a, b) consumed, not yet swept
        self._pending: dict[str, list[tuple[int, int]]] = {}  # path -> consumed [a, b) not yet hashed
        self._planned_ranges: dict[str, list[tuple[int, int]]] = {}  # path -> [a, b) the conversion reads
        self._read: dict[str, list[tuple[int, int]]] = {}  # path -> merged [a, b) it has read
        self._planning = True  # the hash waits until plan_done()
        self._finished = False
        self._files = FileAdvice()
        self._cv = threading.Condition(threading.RLock())  # consumed() may run as a finalizer in any call
        self.released_bytes = 0

    def _drop(self, path: str, a: int, b: int) -> None:
        if self._files.advise(path, a, b - a, os.POSIX_FADV_DONTNEED):
            self.released_bytes += b - a

    def consumed(self, path: "str | os.PathLike[str]", offset: int, nbytes: int) -> None:
        """The conversion is done with ``nbytes`` at ``offset`` of ``path`` (released at the next
        :meth:`sweep`, and once hashed if the source is). Any thread; also a weakref finalizer."""
        with self._cv:
            self._ready.append((str(path), offset, offset + nbytes))

    def sweep(self) -> None:
        """Release what every reader is done with."""
        with self._cv:
            while self._ready:
                path, a, b = self._ready.popleft()
                h = self._hashed_to.get(path, 0) if self._hashed else b
                self._drop(path, a, min(b, h))
                if b > h:
                    self._pending.setdefault(path, []).append((max(a, h), b))

    def hashed_to(self, path: "str | os.PathLike[str]", offset: int) -> None:
        """The hash has read ``path`` from its start up to ``offset``."""
        self.sweep()
        path = str(path)
        with self._cv:
            self._hashed_to[path] = offset
            keep = []
            for a, b in self._pending.get(path, []):
                self._drop(path, a, min(b, offset))
                if b > offset:
                    keep.append((max(a, offset), b))
            self._pending[path] = keep

    def plan(self, path: "str | os.PathLike[str]", offset: int, nbytes: int) -> None:
        """The conversion will read ``nbytes`` at ``offset`` of ``path`` (said before :meth:`plan_done`);
        kept only with ``hashed`` (it paces the hash)."""
        if not self._hashed:
            return
        with self._cv:
            self._planned_ranges.setdefault(str(path), []).append((offset, offset + nbytes))

    def plan_done(self) -> None:
        """Every range the conversion reads is planned: the hash may start."""
        with self._cv:
            for ranges in self._planned_ranges.values():
                ranges.sort()
            self._planning = False
            self._cv.notify_all()

    def read(self, path: "str | os.PathLike[str]", offset: int, nbytes: int) -> None:
        """The conversion has read ``nbytes`` at ``offset`` of ``path`` (its pages are in the page cache);
        kept only with ``hashed``."""
        if not self._hashed:
            return
        path = str(path)
        with self._cv:
            merged = self._read.get(path, [])
            bisect.insort(merged, (offset, offset + nbytes))
            out: list[tuple[int, int]] = []
            for a, b in merged:  # kept merged: reads arrive nearly in file order, so this stays short
                if out and a <= out[-1][1]:
                    out[-1] = (out[-1][0], max(out[-1][1], b))
                else:
                    out.append((a, b))
            self._read[path] = out
            self._cv.notify_all()

    def _read_already(self, path: str, a: int, b: int) -> bool:
        """Whether every planned byte of ``[a, b)`` of ``path`` has been read."""
        planned = self._planned_ranges.get(path, [])
        merged = self._read.get(path, [])
        i = max(0, bisect.bisect_right(planned, (a, a)) - 1)
        for x, y in planned[i:]:
            if x >= b:
                break
            lo, hi = max(x, a), min(y, b)
            if lo >= hi:
                continue
            j = bisect.bisect_right(merged, (lo, float("inf"))) - 1
            if j < 0 or merged[j][1] < hi:
                return False
        return True

    def wait_hash_room(self, path: "str | os.PathLike[str]", offset: int, nbytes: int,
                       stop: threading.Event) -> None:
        """Block the hash until every planned byte of ``[offset, offset + nbytes)`` of ``path`` has
        been read by the conversion, or :meth:`finish` was called, or ``stop`` is set."""
        path = str(path)
        with self._cv:
            while not (self._finished or stop.is_set()
                       or (not self._planning and self._read_already(path, offset, offset + nbytes))):
                self._cv.wait(0.5)

    def finish(self) -> None:
        """The conversion has read everything it reads (or stopped): the hash goes on unpaced."""
        with self._cv:
            self._finished = True
            self._cv.notify_all()

    def __enter__(self) -> "SourceRelease":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """:meth:`finish` and a last :meth:`sweep` (call it once the conversion's tensors are
        dropped); with ``hashed``, everything the hash has read is released too (tensors the
        conversion never reads, such as a vision tower int8-neuron does not export, and the
        headers), ranges it has not passed yet stay; closes the descriptors it opened."""
        self.finish()
        self.sweep()
        with self._cv:
            counted = self.released_bytes
            for path, end in self._hashed_to.items():
                self._drop(path, 0, end)
            self.released_bytes = counted  # counts consumed ranges only
            self._files.close()


class Prefetcher:
    """Source tensors read ahead in a background thread.

    Args:
        ckpt: the source; the thread reads through its own copy of the handles, opening
            the shard's mmap for one tensor at a time so mapped pages do not add to RSS.
        names: every tensor name, in the order :meth:`get` will ask for them.
        budget_bytes: bytes read but not yet taken, at most (one larger tensor alone, read
            only once everything before it was taken). The consumer's own tensors come on top.
        disk_ahead_bytes: bytes the disk is asked to read ahead of the reads
            (:class:`DiskReadahead`; 0: none), held in the page cache, not in this process.
        release: told of each tensor handed out once the consumer has dropped it
            (:class:`SourceRelease`, swept by the reading thread before each read and while it
            waits for room); None: nothing released.

    Each tensor's NaN/Inf check is done by the reading thread, whose amax :meth:`amax` hands out
    (kept until taken, or until the Prefetcher is dropped).

    Raises (from :meth:`get`): whatever reading raised (CheckpointError for NaN/Inf or a bad shard).
    """

    def __init__(self, ckpt: Checkpoint, names: Sequence[str], budget_bytes: int,
                 disk_ahead_bytes: int = DISK_AHEAD_BYTES, release: SourceRelease | None = None):
        self._release = release
        if release is not None:
            for n in names:
                info = ckpt.tensors[n]
                release.plan(info.path, info.offset, info.nbytes)
        self._ckpt = copy.copy(ckpt)
        self._ckpt._handles = {}
        self._names = list(names)
        self._disk = DiskReadahead(ckpt, self._names, disk_ahead_bytes) if disk_ahead_bytes else None
        self._q = _ByteBudget(budget_bytes)
        self._amax: dict[str, torch.Tensor] = {}  # set by the reading thread before the tensor is queued
        self._handed: dict[str, torch.Tensor] = {}  # those of the tensors get() has handed out, until amax()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="g4-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i, name in enumerate(self._names):
                if self._stop:
                    break
                if self._release is not None:
                    self._release.sweep()
                if self._disk is not None:
                    self._disk.reading(i)  # the disk reads ahead while this waits for room
                nbytes = self._ckpt.tensors[name].nbytes
                # room first, then read; what the consumer dropped meanwhile is released here,
                # not in its thread (page-cache release took 2.5 s of a 10-layer nvfp4 layer loop)
                while not self._q.wait_room(nbytes, timeout=_SWEEP_SECONDS):
                    if self._release is not None:
                        self._release.sweep()
                if self._stop:
                    break
                info = self._ckpt.tensors[name]
                t = self._ckpt.get(name)
                # every byte touched (in the page cache now) by the NaN/Inf check, which also
                # gives the amax the consumer's quantizer needs (amax())
                self._amax[name] = finite_amax(name, t, where=self._ckpt.root / info.file)
                self._ckpt.close()
                if self._release is not None:
                    self._release.read(info.path, info.offset, info.nbytes)
                self._q.put((name, t), t.numel() * t.element_size())
            self._q.finish()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._q.fail(e)
        finally:
            if self._disk is not None:
                self._disk.close()

    def get(self, name: str) -> torch.Tensor:
        """The next tensor; ``name`` must be the next one in the order given."""
        item = self._q.take()
        if item is None or item[0] != name:
            raise RuntimeError(f"prefetch order: asked for {name}, next is {item[0] if item else 'nothing'}")
        if self._release is not None:  # its pages are released once the consumer has dropped it
            info = self._ckpt.tensors[name]
            weakref.finalize(item[1], self._release.consumed, info.path, info.offset, info.nbytes).atexit = False
        self._handed[name] = self._amax.pop(name)
        return item[1]

    def amax(self, name: str) -> torch.Tensor:
        """``max(|t|)`` of tensor ``name`` (fp32; per expert, ``[E]``, for a tensor of 3 or more
        dimensions: :func:`g4.core.checkpoint.finite_amax`), computed by the reading thread as
        its NaN/Inf check; once, after :meth:`get` of that tensor.

        Raises:
            KeyError: ``name`` has not been handed out by :meth:`get`, or its amax was taken.
        """
        return self._handed.pop(name)

    def close(self) -> None:
        """Stop reading ahead and wait for the thread."""
        self._stop = True
        with self._q.cv:
            self._q.items.clear()
            self._q.bytes = 0
            self._q.cv.notify_all()
        self._thread.join()


class InOrder(Mapping):
    """A mapping ``name -> tensor`` of a step's tensors (e.g. a decoder layer's), each taken from
    a :class:`Prefetcher` when first asked for and handed out once: the Prefetcher hands them
    out in ``names``' order, so asking for a later one first takes the ones before it (kept here
    until asked for). The consumer can so work on each tensor as it arrives instead of waiting
    for the whole step, and a tensor it has dropped is freed (and its pages released) at once.
    :attr:`amaxes`: :meth:`Prefetcher.amax` of each (``name -> max |t|``), any number of times.

    Raises (on a lookup): KeyError for a name not in ``names`` or already handed out; whatever
    :meth:`Prefetcher.get` raises.
    """

    def __init__(self, reader: Prefetcher, names: Sequence[str]):
        self._reader, self._names = reader, list(names)
        self._known = set(self._names)
        self._next = 0
        self._got: dict[str, torch.Tensor] = {}  # taken, not yet handed out
        self._amax: dict[str, torch.Tensor] = {}

    def _take(self, name: str) -> None:
        if name not in self._known:
            raise KeyError(name)
        while name not in self._amax:
            n = self._names[self._next]
            self._got[n] = self._reader.get(n)
            self._amax[n] = self._reader.amax(n)
            self._next += 1

    def __getitem__(self, name: str) -> torch.Tensor:
        self._take(name)
        return self._got.pop(name)  # KeyError: handed out before

    @property
    def amaxes(self) -> Mapping[str, torch.Tensor]:
        # made when asked for, not kept: a reference back from it would make a cycle, and the
        # step's tensors (and the release of their pages) would wait for the cyclic GC
        return _Taken(self, self._amax)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:  # Mapping's would take (and hand out) the tensor
        return name in self._known

    def take_rest(self) -> None:
        """Take (and drop) every tensor not asked for yet: the Prefetcher's next one is then the
        next step's."""
        if self._names:
            self._take(self._names[-1])
        self._got.clear()


class _Taken(Mapping):
    """:attr:`InOrder.amaxes`."""

    def __init__(self, owner: InOrder, values: dict):
        self._owner, self._values = owner, values

    def __getitem__(self, name: str) -> torch.Tensor:
        self._owner._take(name)
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)


class BackgroundWriter:
    """Writes ``(writer, name, tensor)`` in background threads: each tensor is claimed in queue
    order by the caller (``ShardedSafetensorsWriter.claim``: name, dtype and shape checked
    there) and written at its planned place by one of ``threads`` threads
    (``ShardedSafetensorsWriter.put``), several tensors at once: on the 2-core machine of
    ``bench/bench_convert.py`` one thread wrote new file data at a third of the speed of two.

    Args:
        budget_bytes: bytes queued or being written, at most (one larger tensor alone);
            the tensors are held, not copied, so the caller must not modify them afterwards.
        threads: writing threads.
        on_written: called in a writing thread after each tensor with its bytes (e.g. a progress bar).
        release: told of each source range :meth:`copy` has copied (:class:`SourceRelease`).
    """

    def __init__(self, budget_bytes: int, threads: int = WRITE_THREADS, on_written=None,
                 release: SourceRelease | None = None):
        self._release = release
        self._advice = FileAdvice()  # for copy(check=...)
        self._q = _ByteBudget(budget_bytes)
        self._on_written = on_written
        self._threads = [threading.Thread(target=self._run, name=f"g4-write-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        try:
            while (item := self._q.take()) is not None:
                job, args, held, nbytes = item
                job(*args)
                if held:
                    self._q.release(held)
                if self._on_written is not None:
                    self._on_written(nbytes)
        except BaseException as e:  # noqa: BLE001 - handed to the producer
            self._q.fail(e)

    def write(self, writer, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` as the next tensor of ``writer`` (see ``ShardedSafetensorsWriter.write``).

        Raises:
            ExportError: ``tensor`` is not the next planned tensor of ``writer`` (from ``claim``).
            whatever a writing thread raised before.
        """
        if self._q.error is not None:
            raise self._q.error
        slot = writer.claim(name, tensor)
        row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() and len(tensor) else 0
        rows = max(1, WRITE_PIECE_BYTES // row_bytes) if row_bytes else 1
        for r0 in range(0, max(len(tensor) if tensor.dim() else 1, 1), rows):  # pieces the threads share
            piece = tensor[r0 : r0 + rows] if tensor.dim() else tensor
            n = piece.numel() * piece.element_size()
            self._q.put((writer.put, (slot, piece, r0), n, n), n, held=True)

    def copy(self, writer, name: str, source, *, release: bool = True,
             check: Callable[[int, int], None] | None = None) -> None:
        """Queue planned tensor ``name`` of ``writer`` as a copy of the stored bytes of source
        tensor ``source`` (a ``TensorInfo``: path, offset, dtype, shape), ahead of its turn
        (``ShardedSafetensorsWriter.claim_early``, ``copy_in``): for a tensor kept exactly as
        stored, written while the layers are still being quantized; it takes no RAM. ``release``:
        tell the writer's :class:`SourceRelease` the copied range is done with (False when the
        same bytes are read again later, or they would come from the disk twice). ``check``: called
        as ``check(first_byte, nbytes)`` in the writing thread before each piece is copied, with the
        disk asked for the piece first (``POSIX_FADV_WILLNEED``), e.g. the NaN/Inf check of the
        source bytes (:meth:`g4.core.checkpoint.Checkpoint.check_finite_part`): the piece is then
        read from the disk once, for both; what it raises comes back as any writing error does.

        Raises:
            ExportError: ``name`` is not planned, already claimed, or planned in another dtype/shape.
            whatever a writing thread raised before.
        """
        if self._q.error is not None:
            raise self._q.error
        slot = writer.claim_early(name, source.dtype, source.shape)
        if self._release is not None:
            self._release.plan(source.path, source.offset, source.nbytes)
        for b0 in range(0, max(source.nbytes, 1), WRITE_PIECE_BYTES):
            n = min(WRITE_PIECE_BYTES, source.nbytes - b0)
            self._q.put((self._copy_piece, (writer, slot, source, b0, n, release, check), 0, n), 0)

    def _copy_piece(self, writer, slot, source, b0: int, n: int, release: bool,
                    check: Callable[[int, int], None] | None = None) -> None:
        if check is not None:
            self._advice.willneed(source.path, source.offset + b0, n)  # large reads, not page faults
            check(b0, n)
        writer.copy_in(slot, source.path, source.offset, b0, n)
        if self._release is not None:
            self._release.read(source.path, source.offset + b0, n)
        if release and self._release is not None:  # read with pread, never mapped: released at the next sweep
            self._release.consumed(source.path, source.offset + b0, n)

    def close(self) -> None:
        """Write everything queued, stop the threads, raise a thread's error if any."""
        self._q.finish()
        for t in self._threads:
            t.join()
        self._advice.close()
        if self._q.error is not None:
            raise self._q.error


@contextmanager
def overlapped(ckpt: Checkpoint, reads: Sequence[str], *, write_behind_bytes: int = WRITE_BEHIND_BYTES,
               bar=None, release: SourceRelease | None = None) -> Iterator[tuple[Prefetcher, BackgroundWriter]]:
    """A conversion's layer loop with reading and writing in the background: yields the
    :class:`Prefetcher` of ``reads`` (at most one tensor or :data:`READ_AHEAD_BYTES` ahead) and a
    :class:`BackgroundWriter` (``write_behind_bytes`` behind). On a normal exit it waits for
    every queued write (``bar`` shows "writing") and closes ``ckpt``'s file mappings; on any
    exit both threads are stopped. A thread's error is raised again here. ``release``: given the
    source ranges the loop is done with (:class:`SourceRelease`), and finished on exit."""
    reader = Prefetcher(ckpt, reads, budget_bytes=READ_AHEAD_BYTES, release=release)
    out = BackgroundWriter(budget_bytes=write_behind_bytes, release=release)
    try:
        yield reader, out
        if bar is not None:
            bar.set_postfix_str("writing", refresh=False)
        out.close()
    finally:
        reader.close()
        if release is not None:
            release.finish()
        out.close()
    ckpt.close()


class BackgroundHashes:
    """Hex sha256 of ``files`` (``{name: path}``), computed by ``threads`` daemon threads (a file
    each, in order), 16 MiB at a time, while the caller converts: the int8-neuron manifest records
    its source's hashes, and hashing 51.6 GB after the conversion took as long as a third of it
    (about 1.3 GB/s a core with SHA-NI).
    :meth:`close` stops it at the next 16 MiB (an aborted conversion does not wait for it).
    Same digests as :func:`g4.core.checkpoint.file_sha256`. ``release``: the conversion's
    :class:`SourceRelease` (``hashed=True``), which paces the hash behind the conversion's reads
    and is told how far each file is hashed."""

    _CHUNK = 16 << 20

    def __init__(self, files: dict[str, "str | os.PathLike[str]"], release: SourceRelease | None = None,
                 threads: int = HASH_THREADS):
        self._release = release
        self._files = dict(files)
        self._todo = iter(list(self._files.items()))  # files in order, taken by the threads in turn
        self._lock = threading.Lock()
        self._digests: dict[str, str] = {}
        self._error: tuple[str, OSError] | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"g4-hash-{i}", daemon=True)
                         for i in range(max(1, min(threads, len(self._files))))]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                name, path = next(self._todo, (None, None))
            if name is None or self._stop.is_set():
                return
            h = hashlib.sha256()
            try:
                with open(path, "rb", buffering=0) as f:
                    done = self._hash_file(f, str(path), h)
            except (OSError, ValueError) as e:  # ValueError: mmap of a file that is not a regular file
                with self._lock:
                    if self._error is None:
                        self._error = (str(path), e if isinstance(e, OSError) else OSError(str(e)))
                self._stop.set()  # the other threads stop at their next chunk
                return
            if not done:
                return
            with self._lock:
                self._digests[name] = h.hexdigest()

    def _hash_file(self, f, path: str, h) -> bool:
        """Hash the file ``f`` into ``h``, :attr:`_CHUNK` bytes at a time, each chunk mapped
        read-only (``MAP_POPULATE``: its pages mapped in one call), hashed straight from the page
        cache and unmapped: no copy into this process (reading it into a buffer took 25-30% more
        CPU than the hash itself here, which at 1.3 GB/s, SHA-NI, is the largest CPU cost of an
        int8-neuron conversion after the quantization), and one chunk mapped at a time, so RSS
        holds at most one chunk of it. False: stopped by :meth:`close`."""
        size = os.fstat(f.fileno()).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        at = 0
        while at < size:
            n = min(self._CHUNK, size - at)
            if self._release is not None:
                self._release.wait_hash_room(path, at, n, self._stop)
            if self._stop.is_set():
                return False
            with mmap.mmap(f.fileno(), n, flags=flags, prot=mmap.PROT_READ, offset=at) as m:
                h.update(m)
            at += n
            if self._release is not None:
                self._release.hashed_to(path, at)
        return True

    def result(self) -> dict[str, str]:
        """``{name: hex sha256}`` of every file, in name order (not the order the threads finished
        them in: the manifest's bytes are the same every run), once all are hashed (waits).

        Raises:
            CheckpointError: a file could not be read (named), or :meth:`close` came first.
        """
        for t in self._threads:
            t.join()
        if self._error is not None:
            path, e = self._error
            raise CheckpointError(f"{path}: cannot read to hash it ({e.strerror or e})")
        if len(self._digests) != len(self._files):
            raise CheckpointError("source hashing was stopped before it finished")
        return dict(sorted(self._digests.items()))

    def close(self) -> None:
        """Stop hashing (at the next 16 MiB); the thread is a daemon and never blocks exit."""
        self._stop.set()
