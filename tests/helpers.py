"""What many test modules need: the two command lines run in-process or as a subprocess, the
one-line ``error:`` check, free TCP ports for the engines' gloo groups and servers, and the wait
on a lane's worker processes."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner, Result

from g4.convert.cli import main as g4convert_main
from g4.serve.cli import main as g4serve_main


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports on ``host``, each free a moment ago, all below the kernel's ephemeral
    range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default). A port from a bind to
    port 0 is drawn from that range, and so are the ports of every socket gloo or an HTTP client binds
    or connects from afterwards: such a socket can take it before the worker's TCPStore binds it, and
    two bind-0 calls can give the same port. Then one rank's rendezvous fails or meets a stranger while
    the other waits for its 30-minute gloo timeout. (Where the range starts below 12000, the ports
    are drawn from 10000-11999, inside it.) Raises ``RuntimeError`` when no ``n`` are free."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    low = max(low, 12000)
    held: list[socket.socket] = []
    try:
        for port in random.Random().sample(range(10000, low), min(low - 10000, 64 * n)):
            s = socket.socket()
            try:  # no SO_REUSEADDR: a port still in TIME_WAIT is refused here, not by the worker
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            held.append(s)
            if len(held) == n:
                return [s.getsockname()[1] for s in held]
        raise RuntimeError(f"no {n} free TCP ports on {host} below {low}")
    finally:
        for s in held:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port on ``host`` that was free a moment ago (:func:`free_ports`)."""
    return free_ports(1, host)[0]


def wait_workers(workers: list[tuple[str, Path, subprocess.Popen]], timeout_s: float) -> list[str]:
    """Wait for a lane's worker processes (``label``, its log file, the process) for at most
    ``timeout_s`` seconds in all. The first to exit non-zero, or the deadline, ends the wait: every
    worker still running is killed, since the ranks of a TP group wait on each other's collectives
    for gloo's 30 minutes. Returns one message per failed worker: its label, ``exit N``, ``killed after
    another worker failed`` or ``no exit in T s``, and its log's last 3000 characters; empty when
    every worker exited 0."""
    deadline = time.monotonic() + timeout_s
    pending = list(workers)
    failed = False
    while pending and not failed and time.monotonic() < deadline:
        time.sleep(0.2)
        for w in [w for w in pending if w[2].poll() is not None]:
            pending.remove(w)
            failed |= w[2].returncode != 0
    killed = {id(p) for _, _, p in pending}
    for _, _, p in pending:
        p.kill()
        p.wait()
    failures = []
    for label, log, p in workers:
        if p.returncode != 0:
            status = (f"exit {p.returncode}" if id(p) not in killed else
                      "killed after another worker failed" if failed else f"no exit in {timeout_s:.0f} s")
            failures.append(f"{label}: {status}\n{log.read_text(errors='replace')[-3000:]}")
    return failures


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


def native_nvfp4_kernel(check=None, cflags=None, method: str = "max"):
    """A :class:`g4.quantizers.native.NativeKernel` of the native NVFP4 ``method`` kernel
    (:data:`g4.quantizers.nvfp4.NATIVE` or ``NATIVE_MSE``), not yet built or loaded in this process
    (``check``: the probe check, default the real one; ``cflags``: default
    :data:`g4.quantizers.native.CFLAGS`)."""
    from g4.quantizers import native, nvfp4

    k = nvfp4._NATIVE[method]
    return native.NativeKernel(k.source.name, k.symbol, k.argtypes, k.restype, label=k.label, eager_env=k.eager_env,
                               check=check or k.check, cflags=native.CFLAGS if cflags is None else cflags)


def native_nvfp4_unchecked(extra_flags: tuple[str, ...] = (), build: str = "native", method: str = "max"):
    """The native NVFP4 ``method`` function built in a temporary directory (with ``extra_flags``, e.g.
    ``-mno-avx512f`` for the AVX2 path), without its probe check, so a wrong byte shows in the
    test that finds it; skips where the source does not build that way (no C compiler, neither
    AVX-512 nor AVX2)."""
    import tempfile
    from pathlib import Path

    import pytest

    from g4.quantizers import native

    kernel = native_nvfp4_kernel(check=lambda fn: True, cflags=native.CFLAGS + tuple(extra_flags), method=method)
    with tempfile.TemporaryDirectory(prefix="g4-native-test-") as tmp:
        lib = Path(tmp) / "nvfp4_native.so"
        try:
            kernel._build(lib)
        except native.NativeBuildError as e:
            pytest.skip(f"the native NVFP4 kernel does not build here as {build} ({e})")
        return kernel._open(lib)  # the mapping outlives the file


def native_nvfp4_or_skip() -> None:
    """Skip where the native NVFP4 kernels (g4.quantizers.nvfp4.NATIVE, NATIVE_MSE) do not build here
    (no C compiler, neither AVX-512 nor AVX2); fail where they build but do not give the eager bytes
    (a wrong kernel must not turn its tests into skips)."""
    from g4.quantizers import nvfp4

    native_nvfp4_unchecked()
    for method, kernel in nvfp4._NATIVE.items():
        assert kernel.load() is not None, f"the native NVFP4 {method} kernel builds here but does not give the eager bytes"
