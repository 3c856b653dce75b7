"""Opt-in GPU test: the vLLM backend for real, where vLLM and a CUDA GPU are present in this
environment (``g4.serve.vllm_backend.vllm_status()``). It converts the embedded model to NVFP4
(W4A4 and W4A16), serves each with ``vllm serve`` as ``g4serve`` builds the command for this GPU
and vLLM version (Marlin pins below compute capability 10), and runs ``g4serve check`` against
the bf16 source through the chat endpoint: facts answered, greedy agreement, thinking on/off x
stream/non-stream. Skipped everywhere else (this is the only test that runs vLLM's NVFP4 MoE
kernels; it has not been run yet: no GPU was available to the project so far).

    python3 -m venv .venv-gpu && .venv-gpu/bin/pip install vllm pytest -e . && .venv-gpu/bin/python -m pytest -q -s tests/lanes/test_vllm_gpu.py
"""

import json

import pytest
from click.testing import CliRunner

from g4.convert.embedded_model import EMBEDDED_DIR
from g4.convert.nvfp4 import convert_nvfp4
from g4.serve.vllm_backend import vllm_status

AVAILABLE, WHY = vllm_status()
pytestmark = [pytest.mark.vllm_gpu, pytest.mark.skipif(not AVAILABLE, reason=f"needs vLLM and a CUDA GPU: {WHY}")]


@pytest.mark.parametrize("weight_only", [False, True], ids=["w4a4", "w4a16"])
def test_g4serve_check_through_vllm_on_gpu(tmp_path, weight_only):
    from g4.serve.cli import main

    out = tmp_path / "nvfp4"
    convert_nvfp4(EMBEDDED_DIR, out, weight_only=weight_only, progress=False)
    result = CliRunner().invoke(main, ["check", str(out), "--against", "embedded", "--backend", "vllm"])
    report = json.loads((out / "verification.json").read_text())
    assert report["backend"] == "vllm", result.output
    assert result.exit_code == 0, result.output
    assert report["passed"] and report["overall"]["facts_correct"] == report["overall"]["facts_total"] == 12
    assert all(c["ok"] for c in report["chat_checks"])
