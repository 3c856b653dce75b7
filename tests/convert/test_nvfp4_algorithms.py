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
        err = (x - q.e2m1_round(x / sg) * sg).square().sum(-1)
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


def correlated_layer(seed: int, n: int = 1024, din: int = 256, dout: int = 64):
    """Inputs with correlated features and a few large channels (as LLM activations), a weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, din, generator=g) @ (torch.eye(din) + 2 * torch.randn(din, din, generator=g) / din**0.5)
    x[:, torch.randperm(din, generator=g)[:4]] *= 8
    return x, (torch.randn(dout, din, generator=g) * 0.02).bfloat16()


def output_error(x, w, d):
    return (x @ d.T - x @ w.float().T).square().sum().item()


@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_nvfp4_reduces_the_output_error(seed):
    from g4.quantizers import gptq

    x, w = correlated_layer(seed)
    g = q.global_scale_from_amax(q.weight_amax(w))
    e_max = output_error(x, w, q.dequantize(q.quantize(w)))
    e_mse = output_error(x, w, q.dequantize(q.quantize(w, method="mse")))
    r = gptq.gptq_nvfp4(w, x.T @ x, g)
    assert torch.equal(r.weight_scale_2, g) and r.weight.shape == (64, 128)
    assert output_error(x, w, q.dequantize(r)) < 0.7 * min(e_max, e_mse)
    # the values are on the scales' grid: re-quantizing the dequantized result is a fixed point
    d = q.dequantize(r)
    assert torch.equal(q.dequantize(q.quantize_with_scales(d, r.weight_scale, g)), d)


def test_gptq_int8_reduces_the_output_error_with_nxd_scales():
    from g4.quantizers import gptq, int8

    x, w = correlated_layer(2)
    rtn = int8.quantize(w)
    r = gptq.gptq_int8(w, x.T @ x)
    assert torch.equal(r.scale, rtn.scale) and r.weight.dtype == torch.int8
    assert output_error(x, w, r.weight.float() * r.scale) < 0.5 * output_error(x, w, rtn.weight.float() * rtn.scale)


def test_gptq_experts_use_their_own_tokens_and_few_tokens_fall_back_to_mse():
    """Each expert's GPTQ uses the Hessian of the tokens routed to it (a Hessian from another
    expert's tokens gives a larger error on the expert's own tokens), and an expert below
    GPTQ_MIN_TOKENS gets exactly mse's bytes."""
    from g4.convert.calibrate import GPTQ_MIN_TOKENS, LayerHessians
    from g4.convert.nvfp4 import _gptq_experts

    xs, ws = zip(*(correlated_layer(10 + e, n=512) for e in range(3)))
    w = torch.stack(ws)
    hs = LayerHessians()
    for e in range(3):
        x = xs[e] if e < 2 else xs[e][: GPTQ_MIN_TOKENS - 1]
        hs.add_expert("experts.down_proj", x, e, 3)
    res = _gptq_experts(w, hs, "experts.down_proj", 0)
    mse = q.quantize_experts(w, method="mse")
    for e in range(2):
        own = output_error(xs[e], w[e], q.dequantize_tensors(res.weight[e], res.weight_scale[e], res.weight_scale_2[e]))
        other = output_error(xs[e], w[e], q.dequantize(
            __import__("g4.quantizers.gptq", fromlist=["x"]).gptq_nvfp4(w[e], hs.sums["experts.down_proj"][1 - e],
                                                                       res.weight_scale_2[e])))
        assert own < 0.8 * other, e
    assert torch.equal(res.weight[2], mse.weight[2])
    assert torch.equal(res.weight_scale[2].view(torch.uint8), mse.weight_scale[2].view(torch.uint8))
    assert hs.tokens["experts.down_proj"].tolist() == [512, 512, GPTQ_MIN_TOKENS - 1]


def test_cli_gptq_weight_only_calibrates_and_records(tiny_mm, tiny_mm_nvfp4, tmp_path):
    import json

    from click.testing import CliRunner
    from safetensors.torch import load_file

    from g4.convert.cli import main

    out = tmp_path / "gptq"
    r = CliRunner().invoke(main, ["-q", "nvfp4", str(tiny_mm), str(out), "--algorithm", "gptq", "--weight-only",
                                  "--calib-samples", "4", "--calib-seq-len", "32"])
    assert r.exit_code == 0, r.output
    facts = json.loads((out / "g4_conversion.json").read_text())["options"]
    assert facts["algorithm"] == "gptq" and facts["weight_only"]
    assert "--algorithm gptq --weight-only --calib-samples 4 --calib-seq-len 32" in (out / "README.md").read_text()
    sd = load_file(out / "model.safetensors")
    assert not any(k.endswith("input_scale") for k in sd)
    ref = load_file(tiny_mm_nvfp4 / "model.safetensors")
    k = "model.language_model.layers.0.experts.0.down_proj.weight"
    assert sd[k].shape == ref[k].shape and not torch.equal(sd[k], ref[k])
