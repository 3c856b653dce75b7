"""NVFP4 weight algorithms beyond max: mse block scales (against the full E4M3 sweep that
modelopt's ``mse`` with ``fp8_scale_sweep`` runs) and GPTQ."""

import pytest
import torch
from modelopt.torch.kernels.quantization.gemm._fp8_scale_candidates import fp8_scale_candidates

from g4.quantizers import nvfp4 as q


def block_errors(w: torch.Tensor, qw: q.NVFP4Weight) -> torch.Tensor:
    """Summed squared error per 16-element block, fp32 ``[out, in/16]``."""
    d = q.dequantize(qw) - w.float()
    return d.square().reshape(w.shape[0], -1, q.BLOCK_SIZE).sum(-1)


def full_sweep_errors(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per block, the least squared error over all 126 positive finite E4M3 scales (modelopt's
    candidate set: block amax = global amax * candidate, so the E4M3 scale is the candidate * 448)."""
    x = w.float().reshape(w.shape[0], -1, q.BLOCK_SIZE)
    best = None
    for c in fp8_scale_candidates():
        sg = (c * 448).to(torch.float8_e4m3fn).float() * g
        err = (x - q._e2m1_round(x / sg) * sg).square().sum(-1)
        best = err if best is None else torch.minimum(best, err)
    return best


def weights(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 256, generator=g) * 0.02
    if kind == "heavy":  # Student-t like tails, outliers in some blocks
        w = w / torch.rand(96, 256, generator=g).clamp(min=0.05)
    if kind == "tiny":  # block scales in the E4M3 subnormals
        w = w * 1e-3
        w[0, 0] = 1.0
    return w.bfloat16()


@pytest.mark.parametrize("kind", ["gauss", "heavy", "tiny"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mse_never_worse_than_max_and_as_good_as_the_full_sweep(kind, seed):
    w = weights(kind, seed)
    qmax, qmse = q.quantize(w), q.quantize(w, method="mse")
    assert torch.equal(qmse.weight_scale_2, qmax.weight_scale_2)  # the global scale is max's
    e_max, e_mse = block_errors(w, qmax), block_errors(w, qmse)
    assert (e_mse <= e_max).all()
    assert e_mse.sum() < 0.9 * e_max.sum()  # and clearly better overall
    full = full_sweep_errors(w, qmax.weight_scale_2)
    torch.testing.assert_close(e_mse, full, rtol=1e-5, atol=1e-12)  # the window loses nothing
    # where max is already optimal, the block is max's, byte for byte
    same = e_mse == e_max
    assert same.any()
    assert torch.equal(qmse.weight_scale.view(torch.uint8)[same], qmax.weight_scale.view(torch.uint8)[same])
    codes = lambda t: torch.stack((t.weight & 15, t.weight >> 4), -1).reshape(w.shape[0], -1, 16)  # noqa: E731
    assert torch.equal(codes(qmse)[same], codes(qmax)[same])


def test_mse_compiled_equals_eager(monkeypatch):
    w = weights("heavy", 3)
    eager = q.quantize(w, method="mse")
    if q.MSE_KERNEL.for_size(q.MSE_KERNEL.min_elements) is None:
        pytest.skip("torch.compile unavailable here")
    monkeypatch.setattr(q.MSE_KERNEL, "min_elements", 0)
    fused = q.quantize(w, method="mse")
    assert torch.equal(fused.weight, eager.weight)
    assert torch.equal(fused.weight_scale.view(torch.uint8), eager.weight_scale.view(torch.uint8))


def test_mse_experts_match_one_by_one_and_zero_blocks():
    w = torch.stack([weights("gauss", 4), weights("heavy", 5), torch.zeros(96, 256).bfloat16()])
    w[0, :, :16] = 0
    qe = q.quantize_experts(w, method="mse")
    for e in range(3):
        one = q.quantize(w[e], method="mse")
        assert torch.equal(qe.weight[e], one.weight)
        assert torch.equal(qe.weight_scale[e].view(torch.uint8), one.weight_scale.view(torch.uint8))
    assert torch.equal(q.dequantize_tensors(qe.weight[2], qe.weight_scale[2], qe.weight_scale_2[2]),
                       torch.zeros(96, 256))
    assert (q.dequantize_tensors(qe.weight[0], qe.weight_scale[0], qe.weight_scale_2[0])[:, :16] == 0).all()


def test_unknown_method_is_an_error():
    with pytest.raises(ValueError, match="unknown NVFP4 block-scale method 'gptq'"):
        q.quantize(torch.ones(2, 16), method="gptq")


def test_cli_mse_recorded_and_weights_closer_than_max(tiny_mm, tiny_mm_nvfp4, tmp_path):
    """`g4convert nvfp4 --algorithm mse`: same tensors and input scales as max, every weight's
    error at most max's (lower in sum), the algorithm in g4_conversion.json and in the card."""
    import json

    from click.testing import CliRunner
    from safetensors.torch import load_file

    from g4.convert.cli import main

    out = tmp_path / "mse"
    r = CliRunner().invoke(main, ["-q", "nvfp4", str(tiny_mm), str(out), "--algorithm", "mse", "--calib-samples", "4",
                                  "--calib-seq-len", "32", "--calib-batch-size", "4", "--calib-dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "g4_conversion.json").read_text())["options"]["algorithm"] == "mse"
    assert "--algorithm mse" in (out / "README.md").read_text()
    assert json.loads((tiny_mm_nvfp4 / "g4_conversion.json").read_text())["options"]["algorithm"] == "max"
    src, a, b = load_file(tiny_mm / "model.safetensors"), load_file(tiny_mm_nvfp4 / "model.safetensors"), \
        load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        if k.endswith("input_scale") or k.endswith("weight_scale_2"):
            assert torch.equal(a[k], b[k]), k
    name = "model.language_model.layers.0.self_attn.o_proj"
    w = src[name + ".weight"]
    errs = [block_errors(w, q.NVFP4Weight(d[name + ".weight"], d[name + ".weight_scale"], d[name + ".weight_scale_2"]))
            for d in (a, b)]
    assert (errs[1] <= errs[0]).all() and errs[1].sum() < errs[0].sum()
    r = CliRunner().invoke(main, ["-q", "nvfp4", str(tiny_mm), str(tmp_path / "x"), "--algorithm", "best"])
    assert r.exit_code == 2 and "Invalid value for '--algorithm'" in r.output
