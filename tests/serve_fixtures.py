"""Shared, process-wide cached inputs of the g4serve tests: the embedded model converted once
to NVFP4 and to int8-neuron (TP=2), their CPU engines, and a scripted engine.

Test modules wrap these in fixtures; the functions are cached here (not in per-module
fixtures) so each conversion and engine load happens once per test session.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from g4.serve.engine import Engine

_ROOT = Path(tempfile.mkdtemp(prefix="g4-serve-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@functools.cache
def embedded_result(kind: str) -> Path:
    """The embedded tiny Gemma 4 converted to ``kind`` (``"nvfp4"`` W4A4 with the default
    calibration, or ``"int8-neuron"`` at TP=2). Read-only: copy before modifying."""
    from g4.convert.embedded_model import EMBEDDED_DIR

    out = _ROOT / kind
    if kind == "nvfp4":
        from g4.convert.nvfp4 import convert_nvfp4

        convert_nvfp4(EMBEDDED_DIR, out, progress=False)
    elif kind == "int8-neuron":
        from g4.convert.int8_neuron import convert_int8_neuron

        convert_int8_neuron(EMBEDDED_DIR, out, tp=2, progress=False)
    else:
        raise ValueError(kind)
    return out


@functools.cache
def cpu_engine(kind: str):
    """The CPU engine (defaults: W4A4 emulation for NVFP4, bf16) of :func:`embedded_result`."""
    from g4.serve.engine import load_cpu_engine

    return load_cpu_engine(embedded_result(kind))


@functools.cache
def cpu_app(kind: str):
    """One FastAPI app per engine, shared by the HTTP tests (its worker thread lives on)."""
    from g4.serve.server import create_app

    return create_app(cpu_engine(kind), served_model_name=f"tiny-{kind}")


class ScriptedEngine(Engine):
    """An engine whose model always puts all probability on the next id of ``script``, so the
    real sampling loop, stop ids, parser and HTTP layers run on token sequences (thought blocks,
    multi-byte text) that the embedded model never produces by itself."""

    def __init__(self, tokenizer, script: list[int], path: Path | None = None):
        from g4.convert.embedded_model import EMBEDDED_DIR

        super().__init__(path or EMBEDDED_DIR, tokenizer, "scripted test engine")
        self.script = list(script)
        self.vocab = len(tokenizer)

    def _logits(self, n: int) -> torch.Tensor:
        logits = torch.full((self.vocab,), -1e4)
        logits[self.script[min(n, len(self.script) - 1)]] = 0.0
        return logits

    def start(self, prompt_ids):
        return 0, self._logits(0)

    def step(self, state, token):
        return state + 1, self._logits(state + 1)


def start_g4serve(*args: str, timeout_s: float = 120) -> tuple[subprocess.Popen, int]:
    """``g4serve <args> --port P`` as a user runs it (a separate process, stdout and stderr
    merged into ``proc.stdout``), once ``/health`` answers; returns ``(proc, P)``."""
    from helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from g4.serve.cli import main; main()", *args,
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc, port
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"g4serve {' '.join(args)} did not answer /health in {timeout_s} s") from None
            time.sleep(0.2)
