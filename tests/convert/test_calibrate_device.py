"""Where W4A4 calibration runs (``--calib-device``) and what it costs (the report's per-layer and
per-token figures). The CPU path is the reference; on a CUDA device (skipped without one) the
amaxes must agree with it to the device's matmul rounding."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers import g4convert

from g4.convert.calibrate import LayerCalibrator, calibration_device, make_calibration_ids, read_calibration_texts
from g4.core.checkpoint import Checkpoint
from g4.core.errors import G4Error
from g4.convert.resolve import EMBEDDED_DIR

CUDA = torch.cuda.is_available()


def test_calibration_device_names():
    assert calibration_device("cpu") == torch.device("cpu")
    assert calibration_device("auto") == torch.device("cuda" if CUDA else "cpu")
    for bad in ("tpu", "gpu", "cuda:x", ""):
        with pytest.raises(G4Error, match="expected auto, cpu, cuda or cuda:N"):
            calibration_device(bad)
    with pytest.raises(G4Error, match="CUDA device"):
        calibration_device(f"cuda:{torch.cuda.device_count() if CUDA else 0}")


def test_bad_device_is_one_error_line_before_any_work(tiny_mm, tmp_path):
    r = g4convert("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--calib-device", "tpu")
    assert r.exit_code == 2 and r.output.startswith("error: ") and r.output.count("\n") == 1, r.output
    assert "--calib-device 'tpu'" in r.output and not (tmp_path / "o").exists()
    r = g4convert("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only", "--calib-device", "cpu")
    assert r.exit_code == 2 and "--weight-only does not calibrate" in r.output


@pytest.mark.skipif(CUDA, reason="checks the refusal on a host without CUDA")
def test_cuda_without_a_cuda_device_is_refused(tiny_mm, tmp_path):
    r = g4convert("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--calib-device", "cuda")
    assert r.exit_code == 2 and "torch sees 0 CUDA device(s) here" in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_report_gives_calibration_cost_per_layer_and_token(tiny_mm, tmp_path):
    from g4.convert.nvfp4 import convert_nvfp4

    report = convert_nvfp4(tiny_mm, tmp_path / "o", calib_samples=2, calib_seq_len=32, calib_device="cpu",
                           progress=False)
    assert report.calibration_tokens == 64 and report.layers > 0 and report.calibration_seconds > 0
    per_layer = report.calibration_seconds / report.layers
    assert f"calibration {report.calibration_seconds:.1f} s ({per_layer:.2f} s per layer" in report.summary()
    weight_only = convert_nvfp4(tiny_mm, tmp_path / "w", weight_only=True, progress=False)
    assert weight_only.summary().endswith("; no calibration (weight-only)")


def _calibrate(device: str) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    from transformers import AutoTokenizer

    ckpt = Checkpoint(EMBEDDED_DIR, source=True)
    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    ids = make_calibration_ids(tok, read_calibration_texts(None, tok), samples=4, seq_len=64)
    cal = LayerCalibrator(ckpt, ids, batch_size=2, compute_dtype=torch.float32, device=device, kv_cache=True)
    stats = []
    layers = len(cal.config.layer_types)
    for layer in range(layers):
        prefix = f"{ckpt.prefix}layers.{layer}."
        weights = {n[len(prefix):]: ckpt.get(n) for n in ckpt.tensors if n.startswith(prefix)}
        stats.append(cal.run_layer(layer, weights))
    return stats, cal.hidden


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: compares CUDA calibration with the CPU reference")
def test_cuda_calibration_agrees_with_the_cpu_reference():
    cpu_stats, cpu_hidden = _calibrate("cpu")
    gpu_stats, gpu_hidden = _calibrate("cuda")
    assert gpu_hidden.device.type == "cpu"
    for layer, (a, b) in enumerate(zip(cpu_stats, gpu_stats)):
        assert a.keys() == b.keys(), layer
        for key in a:
            assert b[key].device.type == "cpu"
            torch.testing.assert_close(b[key], a[key], rtol=2e-3, atol=0, msg=f"layer {layer} {key}")
    rel = (gpu_hidden - cpu_hidden).norm() / cpu_hidden.norm()
    worst = max(((b[k] - a[k]).abs() / a[k]).item() for a, b in zip(cpu_stats, gpu_stats) for k in a)
    print(f"CUDA vs CPU calibration: amax max relative difference {worst:.2e}, final hidden states {rel:.2e}")
    assert rel < 1e-3, rel


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_conversion_input_scales_match_the_cpu_conversion(tmp_path):
    from g4.convert.nvfp4 import convert_nvfp4

    kw = dict(calib_samples=4, calib_seq_len=64, progress=False)
    convert_nvfp4(EMBEDDED_DIR, tmp_path / "cpu", calib_device="cpu", kv_cache_dtype="fp8", **kw)
    convert_nvfp4(EMBEDDED_DIR, tmp_path / "gpu", calib_device="cuda", kv_cache_dtype="fp8", **kw)
    a, b = load_file(tmp_path / "cpu" / "model.safetensors"), load_file(tmp_path / "gpu" / "model.safetensors")
    assert a.keys() == b.keys()
    calibrated = (".input_scale", ".k_scale", ".v_scale")  # FP8 KV cache scales too
    scales = [n for n in a if n.endswith(calibrated)]
    assert scales and [n for n in scales if n.endswith(".v_scale")]
    for n in scales:
        torch.testing.assert_close(b[n], a[n], rtol=2e-3, atol=0, msg=n)
    worst = max(((b[n] - a[n]).abs() / a[n]).item() for n in scales)
    print(f"{len(scales)} input_scales and KV cache scales, CUDA vs CPU calibration: max relative difference {worst:.2e}")
    for n in a:  # weights, their scales and everything kept do not depend on the calibration device
        if not n.endswith(calibrated):
            assert torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)), n


def test_calibration_reports_each_batch_for_the_progress_bar(tiny_mm, tmp_path, monkeypatch):
    """The bar's phase counter moves within a layer's calibration: the conversion's bar shows
    "layer L: calibrating, d/n samples" after every batch of every layer, d rising to n."""
    from g4.convert import nvfp4

    shown: list[str] = []

    class Bar:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_postfix_str(self, text, refresh=True):
            shown.append(text)

        def update(self, n):
            pass

    monkeypatch.setattr(nvfp4, "progress_bar", lambda *a, **k: Bar())
    report = nvfp4.convert_nvfp4(tiny_mm, tmp_path / "o", calib_samples=5, calib_seq_len=32, calib_batch_size=2,
                                 progress=True)
    for layer in range(report.layers):
        counts = [t.split(", ")[1] for t in shown if t.startswith(f"layer {layer}: calibrating, ")]
        assert counts == ["2/5 samples", "4/5 samples", "5/5 samples"], (layer, counts)
