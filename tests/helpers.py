"""What many test modules need: the two command lines run in-process or as a subprocess, the
one-line ``error:`` check, and a free TCP port (:func:`g4.serve.check.free_port`)."""

from __future__ import annotations

import os
import subprocess
import sys

from click.testing import CliRunner, Result

from g4.convert.cli import main as g4convert_main
from g4.serve.check import free_port  # noqa: F401  (the tests' free port is g4serve check's)
from g4.serve.cli import main as g4serve_main


def g4convert(*args, quiet: bool = True) -> Result:
    """``g4convert [-q] ARGS`` in this process (click's runner; exceptions are caught into the result)."""
    return CliRunner().invoke(g4convert_main, [*(["-q"] if quiet else []), *map(str, args)])


def g4serve(*args) -> Result:
    """``g4serve ARGS`` in this process; an exception that is not a click exit propagates."""
    return CliRunner().invoke(g4serve_main, [str(a) for a in args], catch_exceptions=False)


def run_module(module: str, *args, env: dict | None = None, cwd=None, timeout: float = 300,
               clean_env: bool = False) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` as a subprocess with text output captured. ``env``: variables
    added to this process's environment (or, with ``clean_env``, the whole environment)."""
    full = dict(env or {}) if clean_env else {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(result, *needles: str) -> str:
    """Assert that a command failed with exit status 2 and printed exactly one non-blank line,
    ``error: ...``, holding every needle; return that line. ``result``: click's ``Result`` or a
    ``subprocess.CompletedProcess`` (its stdout and stderr together)."""
    if isinstance(result, subprocess.CompletedProcess):
        code, output = result.returncode, result.stdout + result.stderr
    else:
        code, output = result.exit_code, result.output
    assert code == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


class LinkedSource:
    """A copy of the embedded source whose files are links into a store (as the Hub cache links
    a snapshot to its blobs), for tests that change SRC while a command reads it: ``src`` (the
    folder of links), ``weights`` (the stored weight file) and :meth:`change`."""

    def __init__(self, tmp_path):
        import shutil

        from g4.convert.embedded_model import EMBEDDED_DIR

        store = shutil.copytree(EMBEDDED_DIR, tmp_path / "store")
        self.src = tmp_path / "src"
        self.src.mkdir()
        for f in store.iterdir():
            (self.src / f.name).symlink_to(f)
        self.weights = next(store.glob("model*.safetensors"))
        self.other = tmp_path / "other.safetensors"
        shutil.copy(self.weights, self.other)

    def change(self, how: str) -> None:
        """``rewritten``: the weight file written again in place (the same bytes); ``relinked``:
        SRC's link to it pointed at ``other`` (a copy of it)."""
        if how == "rewritten":
            self.weights.write_bytes(self.weights.read_bytes())
        else:
            (self.src / self.weights.name).unlink()
            (self.src / self.weights.name).symlink_to(self.other)


def native_nvfp4_kernel(check=None, cflags=None):
    """A :class:`g4.quantizers.native.NativeKernel` of the native NVFP4 kernel's source, not yet built
    or loaded in this process (``check``: the probe check, default the real one; ``cflags``:
    default :data:`g4.quantizers.native.CFLAGS`)."""
    from g4.quantizers import native, nvfp4

    k = nvfp4.NATIVE
    return native.NativeKernel(k.source.name, k.symbol, k.argtypes, k.restype, label=k.label, eager_env=k.eager_env,
                               check=check or k.check, cflags=native.CFLAGS if cflags is None else cflags)


def native_nvfp4_unchecked(extra_flags: tuple[str, ...] = (), build: str = "native"):
    """The native NVFP4 function built in a temporary directory (with ``extra_flags``, e.g.
    ``-mno-avx512f`` for the AVX2 path), without its probe check, so a wrong byte shows in the
    test that finds it; skips where the source does not build that way (no C compiler, neither
    AVX-512 nor AVX2)."""
    import tempfile
    from pathlib import Path

    import pytest

    from g4.quantizers import native

    kernel = native_nvfp4_kernel(check=lambda fn: True, cflags=native.CFLAGS + tuple(extra_flags))
    with tempfile.TemporaryDirectory(prefix="g4-native-test-") as tmp:
        lib = Path(tmp) / "nvfp4_max.so"
        try:
            kernel._build(lib)
        except native.NativeBuildError as e:
            pytest.skip(f"the native NVFP4 kernel does not build here as {build} ({e})")
        return kernel._open(lib)  # the mapping outlives the file


def native_nvfp4_or_skip() -> None:
    """Skip where the native NVFP4 kernel (g4.quantizers.nvfp4.NATIVE) does not build here (no C
    compiler, neither AVX-512 nor AVX2); fail where it builds but does not give the eager bytes (a
    wrong kernel must not turn its tests into skips)."""
    from g4.quantizers import nvfp4

    native_nvfp4_unchecked()
    assert nvfp4.NATIVE.load() is not None, "the native NVFP4 kernel builds here but does not give the eager bytes"
