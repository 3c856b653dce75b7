"""Which backend serves a result: vLLM (NVFP4 on NVIDIA), NxD Inference (int8-neuron on
Inferentia) or the CPU reference (:mod:`g4.serve.engine`), and why, in words.
"""

from __future__ import annotations

from g4.core.errors import G4Error, a_or_an
from g4.exporters.formats import BF16, INT8_NEURON, NVFP4, ResultFormat

BACKENDS = ("auto", "cpu", "vllm", "neuron")


def _backend_status(name: str) -> tuple[bool, str]:
    """``vllm_status()`` / ``neuron_status()`` of the backend modules, imported here, not at the
    top: a backend module may be missing or broken in a CPU-only install, and that is a reason
    to serve on the CPU, not a crash."""
    try:
        if name == "vllm":
            from g4.serve.vllm_backend import vllm_status as status
        else:
            from g4.serve.neuron_backend import neuron_status as status
    except ImportError as e:
        return False, f"the {name} backend cannot be imported ({e})"
    return status()


def choose_backend(fmt: ResultFormat, requested: str = "auto") -> tuple[str, str]:
    """Pick the backend for a result: ``(backend, why in words)``.

    ``auto``: vLLM for NVFP4 when vLLM and a CUDA GPU are present, neuron for int8-neuron when
    neuronx-distributed and NeuronCores are present, otherwise the CPU reference (and always
    the CPU reference for an unquantized checkpoint). An explicit backend is checked.

    Raises:
        G4Error: unknown backend, a backend that cannot serve this format, or one whose
            runtime is not available here (with the reason).
    """
    if requested not in BACKENDS:
        raise G4Error(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    kind = {NVFP4: "NVFP4 result", INT8_NEURON: "int8-neuron result", BF16: "unquantized checkpoint"}[fmt.format]
    native = {NVFP4: "vllm", INT8_NEURON: "neuron", BF16: None}[fmt.format]
    if requested == "cpu":
        return "cpu", f"{kind}, --backend cpu"
    if requested == "auto":
        if native is None:
            return "cpu", f"{kind}: served by the CPU reference (--backend vllm for vLLM)"
        ok, why = _backend_status(native)
        return (native, f"{kind}, {why}") if ok else ("cpu", f"{kind}, {why}")
    if requested == "vllm" and fmt.format == INT8_NEURON:
        raise G4Error(f"{fmt.path}: an int8-neuron result is served by the neuron or cpu backend, not vllm")
    if requested == "neuron" and fmt.format != INT8_NEURON:
        raise G4Error(f"{fmt.path}: the neuron backend serves int8-neuron results; this is {a_or_an(kind)}")
    ok, why = _backend_status(requested)
    if not ok:
        raise G4Error(f"backend {requested} unavailable: {why}")
    return requested, f"{kind}, {why}"
