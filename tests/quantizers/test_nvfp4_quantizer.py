"""NVFP4 quantizer against modelopt's own NVFP4QTensor (the oracle) and hand-typed values."""

import pytest
import torch
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

from helpers import native_nvfp4_or_skip

from g4.quantizers import nvfp4 as q


def modelopt_quantize(w, g=None):
    packed, scale, g2 = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=g)
    return packed._quantized_data, scale, g2


@pytest.fixture(params=["native", "fused", "eager"])
def mode(request, monkeypatch):
    """Run a test with the native kernel (bf16 weights; others take the compiled one),
    the compiled one-pass quantizer and the eager row chunks."""
    if request.param == "native":
        native_nvfp4_or_skip()
        monkeypatch.setattr(q.NATIVE, "min_elements", 0)
        return request.param
    monkeypatch.setattr(q.NATIVE, "function", None)
    if request.param == "eager":
        monkeypatch.setattr(q.KERNEL, "compiled", None)
    elif q.KERNEL.for_size(q.KERNEL.min_elements) is None:
        pytest.skip("torch.compile unavailable here")
    else:
        monkeypatch.setattr(q.KERNEL, "min_elements", 0)
    return request.param


def assert_bit_identical(ours: q.NVFP4Weight, ref):
    assert ours.weight.dtype == torch.uint8 and ours.weight_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(ours.weight, ref[0])
    assert torch.equal(ours.weight_scale.view(torch.uint8), ref[1].view(torch.uint8))
    assert ours.weight_scale_2.shape == () and ours.weight_scale_2.dtype == torch.float32
    assert torch.equal(ours.weight_scale_2, ref[2].reshape(()))


@pytest.mark.parametrize("shape", [(64, 128), (176, 2816), (2816, 64), (7, 16)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_matches_modelopt(shape, seed, dtype, mode):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    assert_bit_identical(q.quantize(w), modelopt_quantize(w))


def test_structured_and_edge_cases_match_modelopt(mode):
    w = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).sin().bfloat16()
    w[0, :16] = 0  # all-zero block
    w[1, :16] = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -5, -0.1, 0.3, 2.906, -6, 0])
    w[2, :16] = torch.tensor([1e-30] * 8 + [1e4] * 8)  # huge dynamic range inside a block
    w[3] = -w[3].abs()  # all negative
    w[4, :16] = torch.tensor([-0.0] * 16)
    assert_bit_identical(q.quantize(w), modelopt_quantize(w))


def test_hand_typed_codes_ties_to_even_and_negative_zero(mode):
    # amax 6: global scale 6/2688, block scale 6 / (6 * g) = 448 exactly, so x / (448 * g) = x.
    x = torch.tensor([[6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -5, -0.1, 0.3, 2.906, -6, 0]])
    out = q.quantize(x)
    codes = torch.stack((out.weight & 0xF, out.weight >> 4), -1).flatten().tolist()
    assert codes == [0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x8, 0xA, 0xE, 0x8, 0x1, 0x5, 0xF, 0x0]
    assert out.weight[0, 0].item() == 0x07  # element 0 in the low nibble, element 1 (code 0) high
    assert out.weight_scale.view(torch.uint8)[0, 0].item() == 0x7E  # fp8 448.0


def test_every_tie_and_its_fp32_neighbours_match_modelopt(mode):
    """The E2M1 rounding at each midpoint between magnitudes (0.25 ... 5, both signs), one fp32
    ulp either side of it, and a dense grid over [-7, 7]: each block led by 6 (so its scale is
    448 and the values reach the rounding nearly unchanged), against modelopt's bytes."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ties = torch.cat([ties, -ties])
    values = torch.cat([ties, torch.nextafter(ties, torch.tensor(9.0)), torch.nextafter(ties, torch.tensor(-9.0)),
                        torch.linspace(-7, 7, 15 * 400)])
    values = torch.cat([values, torch.zeros(-len(values) % 60)]).reshape(-1, 15)  # 4 blocks per row
    w = torch.cat([torch.full((len(values), 1), 6.0), values], dim=1).reshape(-1, 64)
    assert_bit_identical(q.quantize(w), modelopt_quantize(w))


def test_all_zero_weight_gets_finite_positive_scales(mode):
    # modelopt would divide 0 by 0 here; we must never write a NaN or zero scale.
    out = q.quantize(torch.zeros(4, 32))
    assert (out.weight_scale.view(torch.uint8) == 0x38).all()  # fp8 1.0
    assert (out.weight == 0).all() and out.weight_scale_2.item() == pytest.approx(1 / 2688)
    assert (q.dequantize(out) == 0).all()
    with pytest.raises(ValueError, match="not all zero"):
        q.quantize(torch.ones(4, 32), weight_scale_2=torch.tensor(0.0))


def test_global_scale_is_modelopt_multiplier_not_reciprocal():
    w = torch.zeros(16, 16)
    w[3, 5] = 26.88
    assert q.quantize(w).weight_scale_2.item() == pytest.approx(0.01, rel=1e-6)  # not 100 (compressed-tensors)


def test_shared_global_scale_is_used(mode):
    w = torch.randn(32, 64)
    shared = q.global_scale_from_amax(torch.tensor(10.0))
    assert_bit_identical(q.quantize(w, weight_scale_2=shared), modelopt_quantize(w, shared))


def test_dequantize_matches_modelopt_and_bounds_error():
    w = torch.randn(64, 256).bfloat16()
    ours = q.quantize(w)
    packed, scale, g2 = NVFP4QTensor.quantize(w.clone(), 16)
    ref = packed.dequantize(dtype=torch.float32, scale=scale, double_scale=g2, block_sizes={-1: 16})
    deq = q.dequantize(ours)
    assert torch.equal(deq, ref)
    rel = (deq - w.float()).norm() / w.float().norm()
    assert 0.03 < rel < 0.15  # 4-bit: visibly lossy, but bounded


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="2-D"):
        q.quantize(torch.zeros(2, 16, 16))
    with pytest.raises(ValueError, match="multiple of the NVFP4 block size"):
        q.quantize(torch.zeros(4, 24))


def test_experts_in_one_call_match_one_by_one(mode):
    w = (torch.randn(5, 48, 64, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    w[2] = 0  # an all-zero expert gets 1 / 2688, as quantize() gives it
    w[4] *= 100
    batched = q.quantize_experts(w)
    assert batched.weight.shape == (5, 48, 32) and batched.weight_scale_2.shape == (5,)
    for e in range(5):
        one = q.quantize(w[e])
        assert torch.equal(batched.weight[e], one.weight)
        assert torch.equal(batched.weight_scale[e].view(torch.uint8), one.weight_scale.view(torch.uint8))
        assert torch.equal(batched.weight_scale_2[e], one.weight_scale_2)


def test_experts_with_a_given_amax_are_the_same_bytes(mode):
    """quantize_experts(amax=...) (the conversion's reading thread computes it,
    g4.core.checkpoint.finite_amax) gives the bytes it computes itself; a wrong shape is refused."""
    from g4.core.checkpoint import finite_amax

    w = (torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16()
    w[1] = 0
    w[3, 5, 7] = -3.0  # the amax is a negative value's magnitude
    amax = finite_amax("w", w)
    assert amax.dtype == torch.float32 and amax.shape == (4,) and amax[3] == 3.0 and amax[1] == 0
    own, given = q.quantize_experts(w), q.quantize_experts(w, amax=amax)
    assert torch.equal(own.weight, given.weight) and torch.equal(own.weight_scale_2, given.weight_scale_2)
    assert torch.equal(own.weight_scale.view(torch.uint8), given.weight_scale.view(torch.uint8))
    with pytest.raises(ValueError, match="amax of shape"):
        q.quantize_experts(w, amax=amax[:3])


def test_a_failing_compiled_kernel_falls_back_to_the_eager_bytes(monkeypatch, caplog):
    """A compiled kernel that fails to run (no C compiler, a codegen error) is dropped with one
    warning, and the same call gives the eager path's bytes."""
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    monkeypatch.setattr(q.KERNEL, "compiled", None)
    eager = q.quantize(w)

    def broken(*args):
        raise RuntimeError("no C compiler\nmore detail")

    monkeypatch.setattr(q.KERNEL, "compiled", broken)
    monkeypatch.setattr(q.KERNEL, "min_elements", 0)
    with caplog.at_level("WARNING"):
        got = q.quantize(w)
    assert torch.equal(got.weight, eager.weight) and torch.equal(got.weight_scale.view(torch.uint8),
                                                                   eager.weight_scale.view(torch.uint8))
    assert q.KERNEL.compiled is None
    assert "NVFP4: compiled quantizer failed (RuntimeError: no C compiler); using the eager quantizer" in caplog.text
