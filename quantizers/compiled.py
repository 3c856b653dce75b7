"""A quantizer's one-pass kernel compiled by ``torch.compile`` (inductor, C++/OpenMP on the CPU),
with the eager fallback both quantizers share, and a per-machine cache of the kernels packaged
ahead of time.

The kernel is compiled on first use, static in the input width and dynamic in the rows
(``rows_dynamic``: :class:`CompiledKernel` marks them). It is not used for tensors under
``min_elements`` (no compile for small test models), when the ``eager_env`` variable is set to
anything but ``0``, or once a compile or run has failed (no C compiler, a codegen error): the
caller's eager path then gives the same bytes, which the quantizers' tests check.

A conversion can compile its kernels in the background while it reads (:meth:`CompiledKernel.warm`):
in a fresh process the first compile costs seconds even with inductor's on-disk cache (importing
dynamo and inductor, inductor's probe of the CPU's vector instructions, which runs child processes,
and loading each width's compiled code), time the conversion's reads of its first tensors can cover.

The kernel cache (:func:`kernel_cache_dir`, filled by ``g4convert kernels`` through
:meth:`CompiledKernel.save_packages`) holds a rows-dynamic kernel per input width and dtype as an
AOTInductor package (``torch._inductor.aoti_compile_and_package`` of ``torch.export``'s graph;
pytorch/pytorch ``torch/_inductor/package/package.py``): a later process loads it in milliseconds
with PyTorch's C++ loader (``torch._C._aoti.AOTIModelPackageLoader``, what
``torch._inductor.aoti_load_package`` wraps), without importing dynamo or inductor, and uses it
only once it has given the eager kernel's bytes on a probe input. A package is found by a digest
of the machine (torch build, CPU flags) and of the kernel's source file, so an edited quantizer or
another torch never loads an old one. It is compiled once per machine (7-17 s a package here, 28 s
with inductor's own cache empty; the mse kernel about 50 s).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import math
import os
import platform
import re
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_UNSET = object()
# Rows of the zeros CompiledKernel.warm_rows compiles on (dynamic: 0 and 1 would be specialised).
WARM_ROWS = 64
# Where the packaged kernels live: this variable's directory, or ``off`` (or ``0``) for none.
KERNEL_CACHE_ENV = "G4_KERNEL_CACHE"
_PACKAGE_FORMAT = "g4-aoti-1"  # part of every package's digest: bump when the package's form changes


def user_cache_dir(name: str, env: str) -> Path | None:
    """A per-user g4 cache directory: ``$<env>`` where set, else ``$XDG_CACHE_HOME/g4/<name>``
    (``~/.cache/g4/<name>``); None where ``$<env>`` is ``off`` or ``0``, or there is no home
    directory. Not created here. The one rule of every g4 cache (kernels, eval's SRC hidden states)."""
    given = os.environ.get(env, "")
    if given.lower() in ("off", "0"):
        return None
    if given:
        return Path(given).expanduser()
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "g4" / name
    except RuntimeError:  # no home directory to put it in
        return None


def kernel_cache_dir() -> Path | None:
    """The per-machine kernel cache: ``$G4_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/g4/kernels``
    (``~/.cache/g4/kernels``); None where ``G4_KERNEL_CACHE`` is ``off`` or ``0``, or there is no
    home directory (:func:`user_cache_dir`)."""
    return user_cache_dir("kernels", KERNEL_CACHE_ENV)


@functools.cache
def _machine_digest() -> str:
    """What a packaged kernel's machine code depends on besides its source: the torch build, the
    CPU's architecture and flags (inductor compiles for the host's vector instructions)."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if re.match(r"(flags|Features)\s*:", line)), "")
    except OSError:
        flags = platform.processor()
    parts = (_PACKAGE_FORMAT, torch.__version__, str(torch.version.git_version), sys.platform, platform.machine(),
             torch.backends.cpu.get_cpu_capability(), " ".join(sorted(flags.split(":", 1)[-1].split())))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def private_to_user(path: Path, *, directory: bool) -> bool:
    """Whether ``path`` is a directory (or a regular file, not a link) owned by this user that no
    one else can write: the rule for anything g4 loads from a cache (a kernel package is a shared
    library the process loads; eval's cached SRC hidden states decide its statistics), so nobody
    else may have put it there or changed it."""
    try:
        st = path.lstat() if not directory else path.stat()
    except OSError:
        return False
    own = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    return kind and own and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest_intact(path: Path) -> bool:
    """Whether ``path`` is a file whose sha256 is the one recorded beside it (``NAME.sha256``, a
    file only this user can write) when g4 wrote it (:func:`publish`): a damaged library's or
    package's machine code can kill the process (SIGILL, SIGSEGV) before any probe could refuse it."""
    recorded = path.with_name(path.name + ".sha256")
    try:
        return (path.is_file() and private_to_user(recorded, directory=False)
                and recorded.read_text().strip() == _file_sha256(path))
    except (OSError, UnicodeDecodeError):  # unreadable, or not text: not the digest g4 wrote
        return False


def publish(partial: Path, path: Path, mode: int) -> None:
    """Move the finished file ``partial`` (in ``path``'s directory) to ``path`` with ``mode`` (not
    the umask's: a file others can write is never loaded), its sha256 recorded beside it first
    (:func:`digest_intact`). An interrupt leaves no temporary digest; the caller removes
    ``partial`` if it is still there."""
    digest = partial.with_name(partial.name + ".sha256")
    try:
        digest.write_text(_file_sha256(partial) + "\n")
        os.chmod(digest, 0o644)
        os.chmod(partial, mode)
        os.replace(digest, path.with_name(path.name + ".sha256"))
        os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):  # a read-only directory: the error above is the one to see
            digest.unlink(missing_ok=True)


def _private_dir(path: Path) -> bool:
    """Whether ``path`` is a directory owned by this user that no one else can write (a package
    is a shared library the process loads: nobody else may have put it there)."""
    return private_to_user(path, directory=True)


class PackageCompileError(RuntimeError):
    """AOTInductor could not export or compile a kernel here (no C++ compiler, a codegen error)."""


class _Exported(torch.nn.Module):
    """``fn`` as a module, for ``torch.export`` (which exports modules)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor):
        return self.fn(*args)


def _same_bytes(a, b) -> bool:
    """Whether two kernel results (tuples of tensors) are the same tensors, byte for byte."""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) for x, y in zip(a, b))


class CompiledKernel:
    """``fn`` compiled on first use, or None where it must not or cannot run.

    Args:
        fn: the one definition of the arithmetic (run eagerly by the caller otherwise).
        eager_env: environment variable that forces the eager path (e.g. ``G4_NVFP4_EAGER``).
        label: the quantizer's name in log lines.
        min_elements: smallest tensor (elements) worth the compiled kernel.
        rows_dynamic: torch.compile marks the first argument's first dimension (the rows)
            dynamic (one compile per shape of the others); else one compile per shape. A cached
            package is dynamic in the rows either way.
        key: what else the kernel's arithmetic depends on, for the kernel cache's digest (e.g.
            the layout of :func:`g4.quantizers.int8.quantize_to_layout`, by its ``repr``).
        sources: objects (functions, classes, instances) whose source files ``fn`` depends on
            beyond its own, for the same digest.
        packaged_by: the command that packages it (said when it is compiled in the process).

    Attributes:
        compiled: the compiled function, None (eager only), or unset until first needed; tests
            set it to None to run the eager path.
    """

    def __init__(self, fn: Callable, *, eager_env: str, label: str, min_elements: int = 1 << 20,
                 rows_dynamic: bool = False, key: str = "", sources: tuple = (), packaged_by: str = ""):
        self.fn, self.eager_env, self.label, self.min_elements = fn, eager_env, label, min_elements
        self.rows_dynamic, self.key, self.sources, self.packaged_by = rows_dynamic, key, sources, packaged_by
        self.compiled = _UNSET
        self._lock = threading.Lock()  # the first calls may come from two threads (warm())
        self._warming: threading.Thread | None = None
        self._packages: dict[tuple, object] = {}  # signature -> loaded package, or None: none usable

    def for_size(self, numel: int) -> Callable | None:
        """The kernel to call (as ``fn`` is called) for a tensor of ``numel`` elements, or None for
        the eager path; waits for a :meth:`warm` thread to finish first. The kernel is the cached
        package for the input's signature where one loads and gives the eager bytes, else the
        torch.compile'd ``fn``; it raises whatever a failed compile or run raises (the caller then
        calls :meth:`disable` and runs the eager path)."""
        if numel < self.min_elements:
            return None
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()
            if self._warming is warming:  # not a warm() started meanwhile
                self._warming = None
        if os.environ.get(self.eager_env, "") not in ("", "0"):
            self.compiled = None
        return None if self.compiled is None else self._run

    def _run(self, x: torch.Tensor, *extra: torch.Tensor):
        if x.device.type == "cpu" and x.dim() and x.shape[0] >= 2:
            package = self._package(x, extra)
            if package is not None:
                return tuple(package.run([x.contiguous(), *(e.contiguous() for e in extra)]))
        compiled = self._compiled()
        if self.rows_dynamic:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        return compiled(x, *extra)

    def _compiled(self) -> Callable:
        """``fn`` torch.compile'd (once); raises RuntimeError where torch.compile is unavailable."""
        with self._lock:
            if self.compiled is _UNSET:
                if kernel_cache_dir() is not None and self.packaged_by:
                    log.info("%s: compiling the kernel in this process (seconds); `%s`, with this conversion's "
                             "options, packages it once for this machine", self.label, self.packaged_by)
                try:
                    self.compiled = torch.compile(self.fn, dynamic=False)
                except Exception as e:  # noqa: BLE001 - torch.compile raises many types
                    self.compiled = None
                    log.warning("%s: torch.compile unavailable (%s); using the eager quantizer", self.label, e)
            if self.compiled is None:
                raise RuntimeError("torch.compile unavailable")
            return self.compiled

    # ------------------------------------------------------------------------- the kernel cache
    def _signature(self, x: torch.Tensor, extra: tuple[torch.Tensor, ...]) -> tuple:
        """What a package is compiled for: the first argument's shape without the rows and its
        dtype, and the other arguments' shapes and dtypes."""
        return (tuple(x.shape[1:]), x.dtype, tuple((tuple(e.shape), e.dtype) for e in extra))

    @functools.cached_property
    def _source_digest(self) -> str | None:
        digest = hashlib.sha256()
        try:
            for obj in (self.fn, *self.sources):
                code = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
                digest.update(Path(inspect.getsourcefile(code)).read_bytes())
        except (OSError, TypeError):  # no source file: nothing to key a package by
            return None
        return digest.hexdigest()

    def package_path(self, signature: tuple) -> Path | None:
        """The kernel cache's file for ``signature`` (:meth:`_signature`), or None (no cache, no
        source to key it by)."""
        root = kernel_cache_dir()
        if root is None or self._source_digest is None:
            return None
        key = repr((_machine_digest(), self._source_digest, self.fn.__module__, self.fn.__qualname__, self.key,
                    [str(v) for v in signature[:2]], [(s, str(d)) for s, d in signature[2]]))
        name = re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")
        return root / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt2"

    def _package(self, x: torch.Tensor, extra: tuple[torch.Tensor, ...]):
        signature = self._signature(x, extra)
        with self._lock:
            if signature not in self._packages:
                self._packages[signature] = self._load(signature, extra)
            return self._packages[signature]

    def _reload(self, x: torch.Tensor, extra: tuple[torch.Tensor, ...]):
        """:meth:`_package` read from the kernel cache again (not the one this process remembers)."""
        with self._lock:
            self._packages.pop(self._signature(x, extra), None)
        return self._package(x, extra)

    def _probe(self, signature: tuple) -> torch.Tensor:
        """The input a package is exported on and must give the eager bytes on: up to
        :data:`WARM_ROWS` rows (at least 2, about 1M elements at most, a count no other dimension
        has, so the export keeps the rows apart) of seeded Gaussian weights (0.02 scale, as a
        model's) with exact zeros and a few large values."""
        tail, dtype = signature[0], signature[1]
        rows = max(2, min(WARM_ROWS, (1 << 20) // max(1, math.prod(tail))))
        while rows in tail:
            rows += 1
        x = torch.randn(rows, *tail, generator=torch.Generator().manual_seed(0)) * 0.02
        x.view(rows, -1)[:, ::7] = 0
        x.view(rows, -1)[::5, 3 % x[0].numel()] = 3.0
        return x.to(dtype)

    def _load(self, signature: tuple, extra: tuple[torch.Tensor, ...]):
        """The package for ``signature`` from the kernel cache, or None (none there, the cache or
        the file is not this user's own, its sha256 is not the one recorded when it was compiled,
        no loader, or it does not give the eager bytes on :meth:`_probe`)."""
        path = self.package_path(signature)
        if path is None or not path.is_file():
            return None
        if not _private_dir(path.parent) or not private_to_user(path, directory=False):
            log.warning("%s: kernel cache %s is not a directory only this user can write, or %s is not a file only "
                        "this user can write; not loading it", self.label, path.parent, path.name)
            return None
        if not digest_intact(path):
            log.warning("%s: kernel cache package %s is damaged or incomplete (its sha256 is not the one recorded "
                        "when it was compiled); not loading it (`g4convert kernels` compiles it again)", self.label, path)
            return None
        try:
            package = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
            probe = self._probe(signature)
            ok = _same_bytes(tuple(package.run([probe, *(e.contiguous() for e in extra)])), self.fn(probe, *extra))
        except Exception as e:  # noqa: BLE001 - a loader missing from this torch, a damaged package
            log.warning("%s: kernel cache package %s not loaded (%s: %s)", self.label, path, type(e).__name__, e)
            return None
        if not ok:
            log.warning("%s: kernel cache package %s does not give the eager bytes; not used", self.label, path)
            return None
        return package

    def save_packages(self, inputs: Iterable[tuple[int, tuple[int, ...], torch.dtype]], *extra: torch.Tensor
                      ) -> list[tuple[Path, float | None]]:
        """Compile the kernel for each ``(numel, tail, dtype)`` of ``inputs`` (as
        :meth:`warm_rows` takes them: tensors under ``min_elements`` are skipped) into the kernel
        cache as an AOTInductor package, with ``extra`` as the other arguments (their shapes and
        dtypes are part of the signature), unless one there already gives the eager bytes; each
        new package is loaded and checked against the eager kernel before this returns.

        Returns:
            ``(path, seconds)`` per signature: the compile's seconds, or None where the cache had it.

        Raises:
            ValueError: the kernel has no source file, or the kernel cache is off.
            PackageCompileError: AOTInductor could not export or compile the kernel.
            RuntimeError: a package that does not load or does not give the eager bytes.
            PermissionError: the cache directory is not the user's own or others can write it.
            OSError: the cache directory cannot be made or written.
        """
        if kernel_cache_dir() is None:
            raise ValueError(f"the kernel cache is off ({KERNEL_CACHE_ENV}={os.environ.get(KERNEL_CACHE_ENV)})")
        if self._source_digest is None:
            raise ValueError(f"{self.label}: this kernel cannot be packaged (no source file)")
        done = []
        for tail, dtype in dict.fromkeys((tuple(t), d) for n, t, d in inputs if n >= self.min_elements):
            x = self._probe(((*tail,), dtype))
            signature = self._signature(x, extra)
            path = self.package_path(signature)
            try:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as e:
                raise OSError(e.errno, f"the kernel cache ({KERNEL_CACHE_ENV}) cannot be made there: {e.strerror}",
                              str(path.parent)) from e
            if not _private_dir(path.parent):
                raise PermissionError(f"{path.parent}: the kernel cache ({KERNEL_CACHE_ENV}) must be a directory this "
                                      "user owns that no one else can write (its packages are shared libraries g4 "
                                      "loads)")
            if self._reload(x, extra) is not None:
                done.append((path, None))
                continue
            t0 = time.perf_counter()
            log.info("%s: compiling the package for %s %s (seconds to a minute)", self.label, list(tail), dtype)
            from torch.export import Dim, export

            partial = path.with_name(f".partial-{os.getpid()}-{path.name}")  # must end in .pt2
            try:
                import torch._inductor

                with warnings.catch_warnings():  # torch.export's own deprecation notices, not the user's
                    warnings.simplefilter("ignore", FutureWarning)
                    exported = export(_Exported(self.fn), (x, *extra),
                                      dynamic_shapes=(({0: Dim("rows", min=2)}, *([None] * len(extra))),))
                    torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
            except Exception as e:  # noqa: BLE001 - export and inductor raise many types
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise PackageCompileError(f"{self.label}: AOTInductor could not compile the kernel for "
                                          f"{list(tail)} {dtype} ({type(e).__name__}: {first})") from e
            else:
                publish(partial, path, 0o644)
            finally:  # an interrupt anywhere above leaves neither temporary file
                with contextlib.suppress(OSError):
                    partial.unlink(missing_ok=True)
            if self._reload(x, extra) is None:
                raise RuntimeError(f"{self.label}: the package just compiled ({path}) does not load or does not "
                                   "give the eager bytes")
            done.append((path, time.perf_counter() - t0))
        return done

    def warm(self, examples: Iterable[tuple]) -> threading.Thread | None:
        """Load or compile the kernel for each argument tuple of ``examples`` (small tensors of the
        real inputs' dtypes and static sizes, so the real calls find the package or the compiled
        code by its guards) by running it once on them, in order, in a daemon thread; returns the
        thread (join it to wait), or None where the kernel is not compiled (``eager_env`` set, no
        ``torch.compile``). ``examples`` is iterated in that thread (a generator can build its
        tensors there).
        A failure there is left to the real call, which then falls back to the eager path
        (:meth:`disable`). The first real call (:meth:`for_size`) waits for the thread: called
        while dynamo compiles the same function in another thread, it waited for that compile and
        then traced and compiled again (``torch._dynamo.convert_frame``); a second warm() starts
        once the first has finished, so waiting for the last waits for both."""
        if os.environ.get(self.eager_env, "") not in ("", "0") or self.compiled is None:
            return None
        previous = self._warming

        def run() -> None:
            try:
                if previous is not None:
                    previous.join()
                for args in examples:
                    if (fused := self.for_size(self.min_elements)) is None:
                        return
                    fused(*args)
            except Exception as e:  # noqa: BLE001 - the real call meets it again and falls back
                log.debug("%s: warming the compiled kernel failed (%s)", self.label, e)

        thread = self._warming = threading.Thread(target=run, name=f"g4-compile-{self.label}", daemon=True)
        thread.start()
        return thread

    def warm_rows(self, inputs: Iterable[tuple[int, tuple[int, ...], torch.dtype]], *extra: torch.Tensor
                  ) -> threading.Thread | None:
        """:meth:`warm` for a kernel whose first argument is dynamic in its first dimension (the
        rows) and static in the others: ``inputs`` holds ``(numel, tail, dtype)`` of each real
        first argument (its element count, its shape without the rows, its dtype; in the order
        of first use); one package or compile per ``(tail, dtype)`` among those of at least
        ``min_elements``, on :data:`WARM_ROWS` rows of zeros (the kernel marks the rows dynamic, as
        for the real inputs), followed by ``extra`` arguments. Returns the thread, or None (nothing to
        compile, or :meth:`warm`'s None)."""
        given = list(dict.fromkeys((tuple(tail), dtype) for numel, tail, dtype in inputs if numel >= self.min_elements))

        def examples() -> Iterator[tuple[torch.Tensor, ...]]:
            for tail, dtype in given:
                yield (torch.zeros(WARM_ROWS, *tail, dtype=dtype), *extra)

        return self.warm(examples()) if given else None

    def disable(self, e: Exception) -> None:
        """After a failed compile or run: log it once and use the eager path from now on."""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if self.compiled is not None:  # None: _compiled() has logged why
            log.warning("%s: compiled quantizer failed (%s: %s); using the eager quantizer", self.label,
                        type(e).__name__, first)
        self.compiled = None
