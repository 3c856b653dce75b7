"""The native NVFP4 mse kernel (``g4_nvfp4_mse_bf16`` in quantizers/nvfp4_native.c, g4.quantizers.nvfp4
NATIVE_MSE) gives the eager mse kernel's bytes, on the AVX-512 build (16 blocks a vector) and the AVX2
build (a block at a time): every bf16 block amax under global scales across the fp32 range, Gaussian,
heavy-tailed and outlier weights, blocks whose candidate scales tie exactly (the eager order's first
wins), NaN, Inf and zero blocks, 1-3 threads; and the three mse kernels (native, compiled, eager) give
the same bytes on real-shaped experts, which the compiled and eager ones did not while the block
error was torch's ``sum(-1)`` (``nvfp4.block_sum``)."""

from __future__ import annotations

import pytest
import torch

from helpers import native_nvfp4_unchecked
from test_nvfp4_native import eager, every_bf16_amax, run

from g4.quantizers import nvfp4 as q

BUILDS = {"native": (), "avx2": ("-mno-avx512f",)}


@pytest.fixture(scope="module", params=list(BUILDS))
def mse(request):
    """The unchecked native mse function of one build."""
    return native_nvfp4_unchecked(BUILDS[request.param], request.param, method="mse")


def assert_eager_bytes(fn, w: torch.Tensor, g: torch.Tensor, threads: int = 2) -> None:
    packed, scales = run(fn, w, g, threads)
    ref_packed, ref_scales = eager(w, g, q._quantize_blocks_mse)
    bad = (scales != ref_scales).nonzero()
    assert not len(bad), (f"{len(bad)} block scales differ, first at {bad[0].tolist()}: "
                          f"{scales[tuple(bad[0])].item()} against eager {ref_scales[tuple(bad[0])].item()}")
    assert torch.equal(packed, ref_packed)


def test_every_bf16_block_amax_under_global_scales_across_the_fp32_range(mse):
    w = every_bf16_amax()
    finite = w.float().abs().amax()
    for e in range(-120, 121, 30):  # block scales from E4M3's clamp at 2^-9 to its 448 and beyond
        assert_eager_bytes(mse, w, q.global_scale_from_amax(finite) * 2.0 ** e)


@pytest.mark.parametrize("kind", ["gaussian", "heavy", "outliers", "subnormal-scales"])
def test_weights_like_a_models(mse, kind):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(192, 2816, generator=gen) * 0.02
    if kind == "heavy":  # Student-t with 2 degrees of freedom: a few blocks far wider than the rest
        w = w / (torch.randn(192, 2816, generator=gen).square() + torch.randn(192, 2816, generator=gen).square()).sqrt()
    if kind == "outliers":
        w[torch.rand(192, 2816, generator=gen) < 0.002] *= 200
    w = w.bfloat16()
    g = q.global_scale_from_amax(q.weight_amax(w))
    assert_eager_bytes(mse, w, g * (300 if kind == "subnormal-scales" else 1))  # 300x: E4M3's subnormals


def test_exact_ties_keep_the_first_in_the_eager_order(mse):
    """Blocks of E2M1 grid values times powers of two, and constant blocks: exact on several
    candidate scales (errors 0, or equal), where only the eager order (max's, then -16..-1,
    +1..+16, the first least error) decides."""
    gen = torch.Generator().manual_seed(5)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = grid[torch.randint(0, 8, (832, 64), generator=gen)] * torch.where(torch.rand(832, 64, generator=gen) < 0.5,
                                                                        -1.0, 1.0)
    w = w * 2.0 ** torch.randint(-6, 7, (832, 1), generator=gen)
    w[::3] = 1.5
    for g in (1 / 6, 1 / 2688, 1 / 48):
        assert_eager_bytes(mse, w.bfloat16(), torch.tensor(g, dtype=torch.float32))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_nan_inf_and_zero_blocks_and_thread_splits(mse, threads):
    """A NaN block keeps max's NaN scale (E4M3 0x7F), an Inf block max's 448, a zero block max's 1,
    whatever the split of 12291 blocks over threads (ranges of whole 16-block groups, a tail last)."""
    w = torch.randn(4097 * 3, 16, generator=torch.Generator().manual_seed(1)) * 0.02
    w[5, 3], w[4000, 0], w[9000, 15] = float("nan"), float("inf"), float("-inf")
    w[6], w[12290] = 0.0, -0.0
    w = w.reshape(-1, 48).bfloat16()
    g = q.global_scale_from_amax(torch.tensor(0.1))
    assert_eager_bytes(mse, w, g, threads)
    _, scales = run(mse, w, g, threads)
    assert scales.reshape(-1)[5].item() == 0x7F and scales.reshape(-1)[4000].item() == 126


def test_block_sum_adds_halves_level_by_level():
    """``e[k] + e[k + 8]``, then 4, 2 and 1 apart, in fp32: on values where the order shows (a 1 is
    lost against 2^24 alone), that order's sum and not another's."""
    e = torch.zeros(16)
    e[0], e[8], e[1], e[9] = 2.0 ** 24, 1.0, -(2.0 ** 24), 1.0
    assert q.block_sum(e).item() == 1.0  # (2^24 + 1) -> 2^24, (-2^24 + 1) exact, then 1
    assert (((e[0] + e[1]) + e[8]) + e[9]).item() == 2.0  # neighbours first: another sum
    x = torch.randn(5, 7, 16, generator=torch.Generator().manual_seed(0))
    h = x[..., :8] + x[..., 8:]
    h = h[..., :4] + h[..., 4:]
    h = h[..., :2] + h[..., 2:]
    assert torch.equal(q.block_sum(x), h[..., 0] + h[..., 1])


def test_native_compiled_and_eager_mse_give_the_same_bytes_on_real_shaped_experts(monkeypatch):
    """Two experts' [1408, 2816] Gaussian gate_up weights through ``quantize_experts(method="mse")``
    with each kernel: the same bytes (with torch's ``sum(-1)`` as the block error the compiled and
    the eager kernels chose different scales for 2 of these 495,616 blocks here)."""
    w = (torch.randn(2, 1408, 2816, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    native = q.NATIVE_MSE.load()
    monkeypatch.setattr(q.MSE_KERNEL, "compiled", q.MSE_KERNEL.compiled)  # G4_NVFP4_EAGER turns it off for good
    results = {}
    for kernel in ("native", "compiled", "eager"):
        if kernel == "native" and native is None:
            continue
        monkeypatch.setattr(q.NATIVE_MSE, "function", native if kernel == "native" else None)
        if kernel == "compiled" and q.MSE_KERNEL.for_size(q.MSE_KERNEL.min_elements) is None:
            continue
        if kernel == "eager":
            monkeypatch.setenv("G4_NVFP4_EAGER", "1")
        r = q.quantize_experts(w, method="mse")
        if kernel == "compiled":
            assert q.MSE_KERNEL.compiled is not None  # it ran (a failed compile would have fallen back to eager)
        results[kernel] = (r.weight, r.weight_scale.view(torch.uint8))
    assert len(results) >= 2, results.keys()
    for kernel, (packed, scales) in results.items():
        assert torch.equal(scales, results["eager"][1]), (kernel, (scales != results["eager"][1]).sum().item())
        assert torch.equal(packed, results["eager"][0]), kernel


@pytest.mark.parametrize("method", ["max", "mse"])
def test_a_nan_scale_keeps_its_sign_as_torchs_cast(method):
    """Under a global scale whose ``6 g`` overflows (3e38), an Inf block's scale is Inf / Inf, the CPU's
    negative NaN: torch's cast writes E4M3 0xFF, a NaN block's 0x7F; both native kernels the same."""
    fn = native_nvfp4_unchecked(method=method)
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2)) * 0.02
    w[5, 7], w[9, 100], w[20, 33] = float("inf"), float("-inf"), float("nan")
    w = w.bfloat16()
    g = torch.tensor(3e38, dtype=torch.float32)
    packed, scales = run(fn, w, g)
    ref_packed, ref_scales = eager(w, g, q._quantize_blocks if method == "max" else q._quantize_blocks_mse)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(packed, ref_packed)
    assert scales[5, 0].item() == 0xFF and scales[20, 2].item() == 0x7F


@pytest.mark.parametrize("method", ["max", "mse"])
def test_a_transposed_weight_quantizes_as_its_contiguous_copy(method):
    w = (torch.randn(1024, 1024, generator=torch.Generator().manual_seed(4)) * 0.02).bfloat16().t()
    a, b = q.quantize(w, method=method), q.quantize(w.contiguous(), method=method)
    assert torch.equal(a.weight, b.weight)
    assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))
