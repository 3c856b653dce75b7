"""Format detection from a result's own files, and backend choice."""

import json
import shutil

import pytest

from g4.core.errors import CheckpointError, G4Error
from g4.serve import backends
from g4.exporters.formats import BF16, INT8_NEURON, NVFP4, detect_format


def test_real_results(tiny_mm, tiny_mm_nvfp4, tmp_path):
    f = detect_format(tiny_mm_nvfp4)
    assert (f.format, f.w4a4) == (NVFP4, True)
    assert detect_format(tiny_mm).format == BF16
    from g4.convert.int8_neuron import convert_int8_neuron

    out = convert_int8_neuron(tiny_mm, tmp_path / "int8", tp=2, target=None, progress=False).out
    assert detect_format(out).format == INT8_NEURON


def _copy_meta(src, dst, *names):
    dst.mkdir()
    for n in names:
        shutil.copy2(src / n, dst / n)
    return dst


def test_nvfp4_from_either_metadata_file_and_weight_only(tiny_mm_nvfp4, tmp_path):
    cfg = json.loads((tiny_mm_nvfp4 / "config.json").read_text())
    # config.json alone
    only_cfg = _copy_meta(tiny_mm_nvfp4, tmp_path / "cfg", "config.json")
    assert detect_format(only_cfg).format == NVFP4
    # hf_quant_config.json alone (+ a config without quantization_config)
    only_hf = _copy_meta(tiny_mm_nvfp4, tmp_path / "hf", "hf_quant_config.json")
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    (only_hf / "config.json").write_text(json.dumps(plain))
    assert detect_format(only_hf).format == NVFP4
    # W4A16: no input_activations in the config group
    w4a16 = tmp_path / "w4a16"
    w4a16.mkdir()
    qc = cfg["quantization_config"]
    for g in qc["config_groups"].values():
        g.pop("input_activations", None)
    (w4a16 / "config.json").write_text(json.dumps(cfg))
    f = detect_format(w4a16)
    assert (f.format, f.w4a4) == (NVFP4, False) and "W4A16" in f.detail


@pytest.mark.parametrize("files, match", [
    ({"manifest.json": {"format": "other/9"}}, "unknown layout"),
    ({"hf_quant_config.json": {"quantization": {"quant_algo": "FP8"}}, "config.json": {"model_type": "gemma4"}},
     "FP8"),
    ({"config.json": {"model_type": "gemma4", "quantization_config": {"quant_method": "compressed-tensors"}}},
     "compressed-tensors"),
    ({"config.json": {"model_type": "llama"}}, "not Gemma 4"),
    ({"config.json": {"model_type": "gemma4"}}, "no \\*.safetensors"),
    ({}, "no config.json"),
    ({"config.json": "{not json"}, "invalid JSON"),
])
def test_unservable_directories(tmp_path, files, match):
    for name, body in files.items():
        (tmp_path / name).write_text(body if isinstance(body, str) else json.dumps(body))
    with pytest.raises(CheckpointError, match=match):
        detect_format(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        detect_format(tmp_path / "missing")


def test_backend_choice(monkeypatch, tiny_mm, tiny_mm_nvfp4, tmp_path):
    nv, bf = detect_format(tiny_mm_nvfp4), detect_format(tiny_mm)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "g4-int8-neuron/2"}))
    i8 = detect_format(tmp_path)

    # This machine: no vLLM, no Neuron -> auto serves on the CPU and says why.
    backend, why = backends.choose_backend(nv, "auto")
    assert backend == "cpu" and why.startswith("NVFP4 result, ") and "vLLM" in why
    backend, why = backends.choose_backend(i8, "auto")
    assert backend == "cpu" and why.startswith("int8-neuron result, ")
    with pytest.raises(G4Error, match="backend vllm unavailable"):
        backends.choose_backend(nv, "vllm")

    status = {"vllm": (True, "vLLM 0.33.0 and a CUDA GPU of compute capability 10.0"),
              "neuron": (True, "NeuronCores present")}
    monkeypatch.setattr(backends, "_backend_status", lambda name: status[name])
    assert backends.choose_backend(nv, "auto") == ("vllm", "NVFP4 result, " + status["vllm"][1])
    assert backends.choose_backend(i8, "auto")[0] == "neuron"
    assert backends.choose_backend(bf, "auto")[0] == "cpu"  # the source itself: CPU reference
    assert backends.choose_backend(bf, "vllm")[0] == "vllm"
    assert backends.choose_backend(nv, "cpu") == ("cpu", "NVFP4 result, --backend cpu")
    with pytest.raises(G4Error, match="not vllm"):
        backends.choose_backend(i8, "vllm")
    with pytest.raises(G4Error, match="neuron backend serves int8-neuron"):
        backends.choose_backend(nv, "neuron")
    status["vllm"] = (False, "vLLM is not installed")
    assert backends.choose_backend(nv, "auto") == ("cpu", "NVFP4 result, vLLM is not installed")


def test_backend_module_import_failure_is_a_reason(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name.endswith("neuron_backend") or (level and fromlist and "neuron_backend" in (name or "")):
            raise ImportError("no module named neuronx_distributed")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    ok, why = backends._backend_status("neuron")
    assert not ok and "cannot be imported" in why


def test_check_result_reads_headers_only_and_passes_finished_results(tiny_mm_nvfp4, tiny_mm, tmp_path, monkeypatch):
    """check_result (run before verify, check, serve and push trust a result) passes g4's own
    results of every format without reading a tensor: opening a safetensors file for its
    tensors fails the test."""
    import safetensors
    import safetensors.torch

    from g4.core import checkpoint
    from g4.convert.int8_neuron import convert_int8_neuron
    from g4.exporters.formats import check_result

    int8_out = tmp_path / "int8"
    convert_int8_neuron(tiny_mm, int8_out, tp=2, progress=False)

    def no_tensor_reads(*args, **kwargs):
        raise AssertionError(f"a tensor was read: {args}")

    for mod, attr in ((safetensors, "safe_open"), (checkpoint, "safe_open"), (safetensors.torch, "load_file")):
        monkeypatch.setattr(mod, attr, no_tensor_reads)
    assert check_result(tiny_mm_nvfp4).format == NVFP4
    assert check_result(int8_out).format == INT8_NEURON
    assert check_result(tiny_mm).format == BF16
