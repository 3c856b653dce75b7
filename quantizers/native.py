"""Hand-vectorized C kernels: built with the machine's C compiler on first use, kept in the kernel
cache, loaded with :mod:`ctypes`, and used only once they have given the eager kernel's bytes on a
probe.

Where inductor's code for a quantizer stays far from what the CPU can do (NVFP4's ``max`` kernel:
590-690 Melem/s against 2.2-2.4 Gelem/s by hand with AVX-512, 0.8 with AVX2, 2 threads, the same
bytes; its ``mse`` kernel), the C source beside the quantizer holds it (``quantizers/nvfp4_native.c``). It is compiled
with ``$CC`` (else ``cc``) and :data:`CFLAGS` in about 0.3 s. A machine it does not build on (no
compiler, a CPU without the source's vector instructions: the source refuses to compile) leaves
the quantizer on its torch.compile kernel (:mod:`g4.quantizers.compiled`) with one INFO line;
anything else that fails, a library that changes the floating-point mode when loaded, or one
that does not give the eager bytes, does the same with one warning. The library is kept in the
kernel cache (:func:`~g4.quantizers.compiled.kernel_cache_dir`) under a digest of the machine
(torch build, CPU flags), the source, the compiler and the flags, with its sha256 beside it, by
the rules of the cache's packages (a directory and file only this user can write; a damaged or
foreign file is built again); with the cache off it is built in a temporary directory for the
process. The C function releases the GIL (ctypes) and splits its work over
``torch.get_num_threads()`` threads of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from g4.quantizers.compiled import (
    KERNEL_CACHE_ENV,
    _machine_digest,
    digest_intact,
    kernel_cache_dir,
    private_to_user,
    publish,
)

log = logging.getLogger(__name__)

_UNSET = object()
# The flags every native kernel is built with (part of the library's digest); ``-x c``: the source
# is C whatever the compiler (``CC=g++`` would compile it as C++ and mangle the symbol's name);
# ``-ffp-contract=off``: a multiply and an add stay two roundings, as in torch (GCC's default for
# GNU C fuses them into one FMA where the CPU has it, and the mse errors would differ).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-x", "c")
_COMPILE_TIMEOUT_S = 120


class NativeBuildError(RuntimeError):
    """The C compiler is missing or refused the source (e.g. neither AVX-512 nor AVX2 here)."""


def compiler() -> list[str]:
    """The C compiler's command: ``$CC`` split as a shell would (``cc`` where unset).

    Raises:
        NativeBuildError: ``$CC`` does not split (an unclosed quote).
    """
    try:
        return shlex.split(os.environ.get("CC", "")) or ["cc"]
    except ValueError as e:
        raise NativeBuildError(f"CC={os.environ.get('CC')!r} is not a command ({e})") from e


def _first_line(text: str) -> str:
    """The line of a compiler's output that says why it failed: the first naming an error (or
    that something cannot be done) other than the linker driver's summary, else the first."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return next((line for line in lines if ("error" in line or "cannot" in line) and not line.startswith("collect2")),
                lines[0] if lines else "")


def _flushes_subnormals(tiny: float = 5e-324, one: float = 1.0) -> bool:
    """Whether this thread's floating-point unit flushes subnormals to zero (x86 MXCSR's FTZ/DAZ,
    which a library built with ``-ffast-math`` sets when it is loaded): the product is computed
    here, not folded by the compiler."""
    return tiny * one == 0.0


def _run(cmd: list[str], timeout: float = _COMPILE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured as text (undecodable bytes replaced)."""
    return subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=timeout)


@functools.lru_cache(maxsize=None)
def _compiler_version(cc: tuple[str, ...]) -> str:
    """``cc --version``'s output, once per process and command (part of a library's digest).

    Raises:
        NativeBuildError: the compiler cannot be run.
    """
    try:
        return _run([*cc, "--version"], timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"no C compiler ({shlex.join(cc)}: {e})") from e


class NativeKernel:
    """A C function built from ``source`` (a file beside this module) on first use, or None where
    it cannot be (logged once) or must not be (``eager_env`` set).

    Args:
        source: the C file's name in ``g4/quantizers``.
        symbol: the exported function; ``argtypes``/``restype``: its ctypes signature.
        label: the kernel's name in log lines and the cache file's name.
        eager_env: environment variable that forces the eager path (the quantizer's own).
        check: given the loaded function, whether it gives the eager kernel's bytes on a probe
            (a library that does not is never used).
        min_elements: smallest tensor (elements) it is used for (the compiled kernel's rule).
        cflags: the compiler's flags (:data:`CFLAGS`; tests add e.g. ``-mno-avx512f`` to build a
            source's AVX2 path on an AVX-512 machine).

    Attributes:
        function: the loaded ctypes function, None (not used), or unset until first needed;
            tests set it to None to run the other kernels.
    """

    def __init__(self, source: str, symbol: str, argtypes: list, restype, *, label: str, eager_env: str,
                 check: Callable[[Callable], bool], min_elements: int = 1 << 20, cflags: tuple[str, ...] = CFLAGS):
        self.source, self.cflags = Path(__file__).with_name(source), tuple(cflags)
        self.symbol, self.argtypes, self.restype = symbol, argtypes, restype
        self.label, self.eager_env, self.check, self.min_elements = label, eager_env, check, min_elements
        self.function = _UNSET
        self._lock = threading.Lock()

    def for_size(self, numel: int) -> Callable | None:
        """The function to call for a tensor of ``numel`` elements, or None (too small, the eager
        path forced, or no usable library: see :meth:`load`)."""
        if numel < self.min_elements or os.environ.get(self.eager_env, "") not in ("", "0"):
            return None
        return self.load()

    def load(self) -> Callable | None:
        """The function, built or taken from the kernel cache and checked once per process; None
        where it does not build here (logged at INFO: no compiler, or a CPU without the source's
        vector instructions), or where anything else fails or the check does (logged as a warning)."""
        with self._lock:
            if self.function is _UNSET:
                try:
                    self.function = self._load()
                except NativeBuildError as e:
                    log.info("%s: native kernel unavailable (%s); using the torch.compile kernel", self.label, e)
                    self.function = None
                except Exception as e:  # noqa: BLE001 - an optional speed-up: nothing may stop the conversion
                    log.warning("%s: native kernel not used (%s: %s); using the torch.compile kernel", self.label,
                                type(e).__name__, e)
                    self.function = None
            return self.function

    def disable(self, e: Exception) -> None:
        """After a failed run: log it and use the other kernels from now on."""
        if self.function is not None:
            log.warning("%s: native kernel failed (%s: %s); using the torch.compile kernel", self.label,
                        type(e).__name__, e)
        self.function = None

    # ------------------------------------------------------------------------- build and cache
    def _digest(self) -> str:
        """What the library's machine code depends on: the machine, the source, the compiler
        (its command and ``--version``) and the flags."""
        cc = compiler()
        parts = (_machine_digest(), hashlib.sha256(self.source.read_bytes()).hexdigest(), shlex.join(cc),
                 _compiler_version(tuple(cc)),
                 " ".join(self.cflags), self.symbol)
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    def library_path(self) -> Path | None:
        """The kernel cache's file for this machine, source and compiler, or None (cache off).

        Raises:
            NativeBuildError: no C compiler.
        """
        root = kernel_cache_dir()
        return None if root is None else root / f"{self.label.lower().replace(' ', '-')}-{self._digest()}.so"

    def _build(self, out: Path) -> None:
        """Compile :attr:`source` into ``out`` (a shared library)."""
        cmd = [*compiler(), *self.cflags, "-o", str(out), str(self.source)]
        try:
            done = _run(cmd)
        except (OSError, subprocess.SubprocessError) as e:
            raise NativeBuildError(f"{shlex.join(cmd[:1])}: {e}") from e
        if done.returncode != 0:
            why = (_first_line(done.stderr or done.stdout)
                   or f"{shlex.join(cmd[:1])} exited with status {done.returncode}")
            raise NativeBuildError(f"{self.source.name} does not compile here: {why}")
        if not out.is_file():
            raise NativeBuildError(f"{shlex.join(cmd[:1])} wrote no library for {self.source.name}")

    def _open(self, path: Path) -> Callable | None:
        """The checked function from the library at ``path``; None where loading it made this
        thread flush subnormals to zero (put back as it was) or it does not give the eager bytes
        (logged)."""
        flushed = _flushes_subnormals()
        lib = ctypes.CDLL(str(path))
        if _flushes_subnormals() != flushed:
            import torch

            torch.set_flush_denormal(flushed)  # the thread's FTZ/DAZ bits as they were
            log.warning("%s: native kernel %s changed the floating-point mode when loaded (subnormals flushed to "
                        "zero: built with -ffast-math in CC?); not used", self.label, path)
            return None
        fn = getattr(lib, self.symbol)
        fn.argtypes, fn.restype = self.argtypes, self.restype
        if not self.check(fn):
            log.warning("%s: native kernel %s does not give the eager bytes; not used", self.label, path)
            return None
        log.debug("%s: native kernel %s loaded; it gives the eager bytes on the probe", self.label, path)
        return fn

    def _load(self) -> Callable | None:
        path = self.library_path()
        if path is None:  # no cache: built for this process alone
            with tempfile.TemporaryDirectory(prefix="g4-native-") as tmp:
                lib = Path(tmp) / self.source.with_suffix(".so").name
                self._build(lib)
                return self._open(lib)  # the mapping outlives the file
        if not path.is_file():
            self.save()
        if not private_to_user(path.parent, directory=True):
            log.warning("%s: kernel cache %s is not a directory only this user can write; not loading %s from it",
                        self.label, path.parent, path.name)
            return None
        if not private_to_user(path, directory=False):  # a link, or others could have written it: replaced
            log.warning("%s: kernel cache library %s is not a file only this user can write; building it again",
                        self.label, path)
            path.unlink(missing_ok=True)
            self.save()
        if not digest_intact(path):
            log.warning("%s: kernel cache library %s is damaged or incomplete (its sha256 is not the one recorded "
                        "when it was built); building it again", self.label, path)
            path.unlink(missing_ok=True)
            self.save()
        return self._open(path)

    def save(self) -> tuple[Path, float | None]:
        """Build the library into the kernel cache unless it is there: ``(path, seconds or None
        where it was there)``.

        Raises:
            ValueError: the kernel cache is off.
            NativeBuildError: no compiler, or the source does not compile here.
            PermissionError: the cache directory is not the user's own or others can write it.
            OSError: the cache directory cannot be made or written.
        """
        path = self.library_path()
        if path is None:
            raise ValueError(f"the kernel cache is off ({KERNEL_CACHE_ENV}={os.environ.get(KERNEL_CACHE_ENV)})")
        if digest_intact(path):
            return path, None
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not private_to_user(path.parent, directory=True):
            raise PermissionError(f"{path.parent}: the kernel cache ({KERNEL_CACHE_ENV}) must be a directory this "
                                  "user owns that no one else can write (its libraries are loaded into g4)")
        t0 = time.perf_counter()
        partial = path.with_name(f".partial-{os.getpid()}-{threading.get_ident()}-{path.name}")
        try:
            self._build(partial)
            publish(partial, path, 0o755)
        finally:  # an interrupt anywhere above leaves no temporary file
            with contextlib.suppress(OSError):  # a read-only directory: the error above is the one to see
                partial.unlink(missing_ok=True)
        seconds = time.perf_counter() - t0
        log.info("%s: native kernel built in %.2f s: %s", self.label, seconds, path)
        return path, seconds
