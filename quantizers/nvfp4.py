"""NVFP4 weight quantization, bit-exact with NVIDIA Model Optimizer's export.

Format (reference implementation NVIDIA/Model-Optimizer ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``,
``NVFP4QTensor.quantize`` / ``get_weights_scaling_factor``):

- ``weight``: uint8 ``[out, in/2]``, two E2M1 codes per byte, the even element of
  each pair in the low nibble. A code is ``sign << 3 | idx`` where ``idx`` indexes
  the magnitudes ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``; the sign bit is ``x < 0`` of the
  scaled value, so a small negative that rounds to zero is stored as 0x8.
- ``weight_scale``: float8_e4m3fn ``[out, in/16]``, one scale per block of 16
  consecutive elements along the input (last) dimension:
  ``fp8(clamp(amax_block / (6 * weight_scale_2), 2**-9, 448))``; an all-zero block
  gets 1.0 before the clamp.
- ``weight_scale_2``: float32 ``[]``, the per-tensor global scale
  ``amax / (6 * 448)``. It is a *multiplier* (modelopt convention); compressed-tensors
  stores its reciprocal as ``weight_global_scale``.
- ``input_scale``: float32 ``[]``, ``amax(|x|) / (6 * 448)`` from calibration.

Dequantization: ``w = e2m1[code] * float32(weight_scale) * weight_scale_2``.

E2M1 rounding is round-half-to-even with saturation at 6. modelopt does it with a
``searchsorted`` over the midpoints plus a tie fix; here the index is a count of
midpoint comparisons in uint8, which gives the same code for every finite input. All arithmetic is fp32
in modelopt's order (divide by ``6 * g``; multiply ``scale * g`` first, then divide).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.quantizers.compiled import CompiledKernel
from g4.quantizers.native import NativeBuildError, NativeKernel

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK_SIZE = 16
# amax -> global scale divisor, 6 * 448.
NVFP4_SCALE_DENOM = E2M1_MAX * E4M3_MAX
_E4M3_MIN_SCALE = 2.0**-9
# Elements quantized per step (whole rows): bounds the fp32 temporaries (4 MiB each)
# while keeping the number of kernel launches small. 2**20 was fastest on 1 and 2
# cores for the 26B-A4B expert shapes (bench/bench_quantizer.py).
_ROW_CHUNK_ELEMENTS = 1 << 20

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)


@dataclass(frozen=True)
class NVFP4Weight:
    """One quantized Linear weight in modelopt's NVFP4 layout.

    Attributes:
        weight: uint8 ``[out, in/2]`` packed E2M1 codes (even element in the low nibble).
        weight_scale: float8_e4m3fn ``[out, in/16]`` per-block scales.
        weight_scale_2: float32 ``[]`` per-tensor global scale (``amax / 2688``).
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor scale ``amax / (6 * 448)`` as a float32 0-d tensor.

    Used for both ``weight_scale_2`` (amax of the weight, or the max over a fused
    group) and ``input_scale`` (amax of the calibration activations).

    Args:
        amax: non-negative max of ``|x|``; any dtype, any 0-d/1-element tensor or float.

    Returns:
        float32 tensor of shape ``[]``.
    """
    amax = torch.as_tensor(amax).reshape(()).float()
    return amax / NVFP4_SCALE_DENOM


def kv_cache_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """FP8 (E4M3) KV cache scale ``amax / 448`` as a float32 0-d tensor: ``k_scale`` from the
    amax of the keys, ``v_scale`` from that of the values, as modelopt 0.47's HF export
    computes it (NVIDIA/Model-Optimizer ``modelopt/torch/export/unified_export_hf.py``,
    ``kv_cache_max_bound = 448``, and ``quant_utils.py`` ``postprocess_state_dict``:
    ``_amax.float() / 448``, no clamp). vLLM stores ``k / k_scale`` in the E4M3 cache.

    Args:
        amax: non-negative max of ``|k|`` (or ``|v|``); any dtype, 0-d/1-element tensor or float.

    Returns:
        float32 tensor of shape ``[]``.
    """
    return torch.as_tensor(amax).reshape(()).float() / E4M3_MAX


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """``max(|w|)`` as a float32 0-d tensor (exact: the max of bf16 values is a bf16 value).

    Computed with one ``aminmax`` pass (no ``|w|`` temporary); NaN propagates, so a
    non-finite result means a non-finite weight.
    """
    lo, hi = torch.aminmax(w)
    return torch.maximum(-lo.float(), hi.float())


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """E2M1 4-bit codes (0..15, as exact small integers in fp32) of fp32 values already
    divided by their block scale: the nearest E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6),
    ties to the even code, saturating at 6; the sign adds 8 (-0 is code 0).

    E2M1 is evenly spaced within three ranges, so the magnitude index is ``round(2|x|)`` below
    2 (0.25 -> 0, 0.75 -> 2, 1.25 -> 2, 1.75 -> 4), ``round(|x|) + 2`` in [2, 4) (2.5 -> 4,
    3.5 -> 6) and ``6 + (|x| > 5)`` from 4 on; ``torch.round`` rounds half to even as the codes
    do, and ``2|x|`` and the shift by 2 are exact in fp32. Same result as modelopt's
    ``_cast_fp4`` (searchsorted + tie fix) for every finite input (tests/quantizers/test_nvfp4_quantizer.py
    checks every tie, its fp32 neighbours and a dense grid). Compiled, about 6-10% faster than
    counting the 7 midpoints below ``|x|``, with a 0-d global scale (with a per-row ``[rows, 1]``
    scale broadcast into it, 3.5x slower: so experts are quantized one by one). Kept in fp32 (converted to uint8 once,
    by :func:`_pack_codes`): compiled by inductor, fp32 stays vectorized where uint8 accumulators
    fell back to scalar code (2x the time of the whole kernel).
    """
    a = x.abs()
    idx = torch.where(a < 2, torch.round(a * 2), torch.where(a < 4, torch.round(a) + 2, 6 + (a > 5).float()))
    return idx + (x < 0).float() * 8


def _quantize_blocks(blocks: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes (uint8 ``[rows, n*8]``) and fp8 block scales (``[rows, n]``) of
    ``blocks`` ``[rows, n, 16]`` (any float dtype) under the fp32 global scale ``g`` (> 0, ``[]``).

    The one definition of the arithmetic, in modelopt's order; run eagerly on row chunks
    or compiled by :data:`KERNEL` into one pass over the whole tensor.
    """
    x = blocks.float()
    s8 = max_block_scales(x, g)
    return _pack_codes(x, s8, g), s8


def max_block_scales(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """modelopt's block scales ``fp8(clamp(amax_block / (6 g), 2**-9, 448))`` (1.0 before the clamp
    for an all-zero block) of fp32 blocks ``x`` ``[rows, n, 16]``: float8_e4m3fn ``[rows, n]``."""
    s = x.abs().amax(-1) / (E2M1_MAX * g)
    s = torch.where(s == 0, 1.0, s)
    return s.clamp(_E4M3_MIN_SCALE, E4M3_MAX).to(torch.float8_e4m3fn)


def _pack_codes(x: torch.Tensor, s8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes (uint8 ``[rows, n*8]``) of fp32 blocks ``x`` ``[rows, n, 16]`` under the
    block scales ``s8`` (float8_e4m3fn ``[rows, n]``) and the global scale ``g``: two codes per
    byte, the even element in the low nibble (modelopt's packing).

    The codes are computed on whole 16-element blocks, one byte each, and the pairs joined
    through an int16 view of those bytes (element ``2k`` the low byte, ``2k + 1`` the high byte:
    little-endian, as this module's callers and the safetensors format assume), so inductor
    keeps full-width vector loads: taking the even and odd elements as ``[..., 8, 2]`` slices
    compiled into 8-lane loads gathered one element at a time (1.05-1.15 s against 0.71 s for a
    26B-A4B ``gate_up_proj`` layer's 128 x [1408, 2816], 2 threads, the same bytes)."""
    codes = _e2m1_codes(x / (s8.float() * g).unsqueeze(-1)).to(torch.uint8)  # 0..15, exact
    pairs = codes.reshape(x.shape[0], -1).view(torch.int16)  # [rows, n*8]: high byte <= 15, never negative
    return ((pairs & 0xF) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


# torch.compile of _quantize_blocks (inductor, C++/OpenMP on the CPU): one fused kernel with
# no fp32 temporaries: 615-990 Melem/s on 2 cores, 16-27x modelopt on the 26B-A4B shapes
# (bench/bench_quantizer.py, 2026-12-06; 459-519 Melem/s, 10-14x, with the [..., 8, 2] packing
# _pack_codes replaced, in the same session).
# Static in the input dimension (a dynamic one loses the vectorization, 4x slower) and
# dynamic in the rows, so one compile per input width (a few seconds with inductor's
# on-disk cache, up to ~30 s without; for most widths one in all, :data:`_MAX_FOLD`). Tensors under 1M elements stay eager (no
# compile for small test models). G4_NVFP4_EAGER=1, or any compile or run failure (no C
# compiler), uses the eager chunks, which give the same bytes (tests/quantizers/test_nvfp4_quantizer.py
# checks both against modelopt); see g4.quantizers.compiled.
KERNEL = CompiledKernel(_quantize_blocks, eager_env="G4_NVFP4_EAGER", label="NVFP4", rows_dynamic=True,
                        packaged_by="g4convert kernels SRC --algorithm max")



def native_probe() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(w, g)`` pairs a native kernel must give its eager kernel's bytes on before it is used:
    seeded bf16 Gaussian weights ``[63, 2832]`` (0.02 scale, as a model's; split over 2 threads,
    each range with its groups of 16 blocks and one with a tail of 15) with all-zero blocks, exact
    zeros, ``-0``, large and tiny values, a NaN and an Inf, under the global scale of their finite
    amax, under one 300x that (block scales in E4M3's subnormal range) and under 3e38 (``6 g``
    overflows: the Inf block's scale a negative NaN, E4M3 0xFF); and one block per tie of E4M3's
    rounding (its amax half-way between two neighbouring E4M3 values, subnormal ones included)
    under ``g = 1/6``, where ``6 g`` is 1 and the block scale is the amax."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(63, 2832, generator=gen) * 0.02
    w[:, ::7] = 0
    w[::5, 3] = 3.0
    w[1, :64] = 0
    w[2, :16] = -0.0
    w[3, 16:32] = 1e-30
    w = w.bfloat16()
    g = global_scale_from_amax(weight_amax(w))
    w[4, 5], w[5, 40] = float("nan"), float("-inf")
    values = _E4M3_CODE_VALUES[E4M3_MIN_POSITIVE_CODE : E4M3_MAX_CODE + 1]
    ties = ((values[:-1] + values[1:]) / 2)[:, None]  # exact in bf16: one more mantissa bit than E4M3
    blocks = torch.cat([ties, ties * (torch.rand(len(ties), 15, generator=gen) * 2 - 1)], 1).bfloat16()
    # the last: 6 g overflows, so an Inf block's scale is Inf / Inf, a NaN whose sign torch's cast keeps
    return [(w, g), (w, g * 300), (blocks, torch.tensor(1 / 6, dtype=torch.float32)),
            (w, torch.tensor(3e38, dtype=torch.float32))]


def native_call(fn, w: torch.Tensor, g: float, packed: torch.Tensor, scales: torch.Tensor, threads: int) -> None:
    """Run the native function ``fn`` (:data:`NATIVE`'s ``g4_nvfp4_max_bf16`` or :data:`NATIVE_MSE`'s
    ``g4_nvfp4_mse_bf16`` in nvfp4_native.c) on the contiguous bf16 ``w`` ``[rows, in]`` under the
    global scale ``g`` (finite, > 0), writing ``packed`` (uint8 ``[rows, in/2]``) and ``scales``
    (float8_e4m3fn ``[rows, in/16]``), both contiguous, with ``threads`` threads."""
    fn(w.data_ptr(), w.numel() // BLOCK_SIZE, g, packed.data_ptr(), scales.data_ptr(), threads)


def _native_gives_eager_bytes(fn, eager=None) -> bool:
    """Whether the native function ``fn`` gives the bytes of the eager kernel ``eager``
    (:func:`_quantize_blocks` by default) on :func:`native_probe`."""
    for w, g in native_probe():
        packed, scales = _empty_result(*w.shape)
        native_call(fn, w, float(g), packed, scales, 2)
        ref_packed, ref_scales = (eager or _quantize_blocks)(w.reshape(w.shape[0], -1, BLOCK_SIZE), g)
        if not (torch.equal(packed, ref_packed.view(packed.shape))
                and torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8).view(scales.shape))):
            return False
    return True


# The max kernel on contiguous bf16 weights, hand-vectorized for AVX-512 (AVX2 without it) in nvfp4_native.c (the
# arithmetic of _quantize_blocks in the same order; g4.quantizers.native builds, caches and checks
# it): 1.9-2.4 Gelem/s against the compiled kernel's 590-690 on 2 threads, the same bytes, for a
# 26B-A4B gate_up layer [128, 1408, 2816] (bench/bench_quantizer.py, 2026-12-06). Where it cannot
# be built (no C compiler, neither AVX-512 nor AVX2) the compiled kernel runs; G4_NVFP4_EAGER=1: the eager chunks.
NATIVE = NativeKernel("nvfp4_native.c", "g4_nvfp4_max_bf16",
                      [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int],
                      ctypes.c_int, label="NVFP4 max", eager_env="G4_NVFP4_EAGER", check=_native_gives_eager_bytes,
                      min_elements=KERNEL.min_elements)

# ----------------------------------------------------------------------------- mse block scales
# modelopt's ``mse`` algorithm with ``fp8_scale_sweep`` for static NVFP4 weights
# (NVIDIA/Model-Optimizer ``modelopt/torch/quantization/calib/mse.py``, ``NVFP4MSECalibrator``, and
# ``modelopt/torch/kernels/quantization/gemm/_fp8_scale_candidates.py``): the global scale stays
# ``amax / 2688``; each block's E4M3 scale is the positive finite E4M3 value whose quantize-dequantize
# minimises the block's summed squared weight error. modelopt tries all 126 values; here the
# candidates are the E4M3 codes from 16 below max's code to 16 above it, 33 in all: two octaves of
# 8 codes each way for normal scales (a quarter to four times max's), more where the codes are the
# evenly spaced subnormals. A scale under a quarter of max's clips the block amax ``a`` to at most
# ``6 s <= a / 4``, an error of at least ``(3a/4)**2 = 0.5625 a**2``, while max's error is at most
# ``15 (a/6)**2 = 0.42 a**2`` (each of the other 15 elements off by at most half the widest E2M1
# gap, 1, times ``a/6``): none of them can win. Above four times max's scale the block amax maps
# below 1.6 and the small elements round to 0; tests/convert/test_nvfp4_algorithms.py checks against the
# full 126-value sweep that the window finds the same least error on every block of Gaussian,
# heavy-tailed and subnormal-scale weights (8 codes above was not enough for subnormal scales).
# Ties keep max's scale (it is tried first), so a block where max is already optimal gets max's bytes.
MSE_CODE_OFFSETS = (0, *range(-16, 0), *range(1, 17))
_E4M3_CODE_VALUES = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # code -> value
# float8_e4m3fn codes (the byte as uint8) of the positive finite values: 1 (2**-9) to 126 (448);
# 0 is +0, 127 NaN, 128 and up negative (sign bit).
E4M3_MIN_POSITIVE_CODE, E4M3_MAX_CODE = 1, 126


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` rounded to the nearest signed E2M1 value (the value of :func:`_e2m1_codes`' code)."""
    a = y.abs()
    mag = torch.where(a < 2, torch.round(a * 2) * 0.5,
                      torch.where(a < 4, torch.round(a), torch.where(a > 5, 6.0, 4.0)))
    return torch.copysign(mag, y)


def block_sum(e: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension (16: a block) of fp32 ``e`` ``[..., 16]`` -> ``[...]`` in one
    fixed order, halves level by level: ``e[k] + e[k + 8]``, then 4, 2 and 1 apart. With ``sum(-1)``
    torch picks the order by the CPU's vector width and inductor picks its own: on 8 Gaussian
    [1408, 2816] bf16 weights the compiled and the eager mse kernels chose different scales for 11
    of 1,982,464 blocks (two candidates whose errors tie to within rounding), so a result's bytes
    depended on which kernel ran. In this order every mse kernel (eager, compiled, :data:`NATIVE_MSE`)
    gives the same bytes. It costs the compiled kernel (the fallback where the native one does not
    build, and for fp32/fp16 weights): 25-41 Melem/s against 84-89 with ``sum(-1)`` (2 threads,
    2026-12-07)."""
    while e.shape[-1] > 1:
        half = e.shape[-1] // 2
        e = e[..., :half] + e[..., half:]
    return e.squeeze(-1)


def mse_block_scales(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Block scales (float8_e4m3fn ``[rows, n]``) minimising ``sum((x - dq(q(x)))**2)`` per block of
    fp32 ``x`` ``[rows, n, 16]`` over :data:`MSE_CODE_OFFSETS` around max's scale; ties keep max's."""
    base = max_block_scales(x, g).view(torch.uint8).to(torch.int32)
    values = _E4M3_CODE_VALUES.to(x.device)
    best_code, best_err = base, None
    for k in MSE_CODE_OFFSETS:
        code = (base + k).clamp(E4M3_MIN_POSITIVE_CODE, E4M3_MAX_CODE)
        sg = (values[code] * g).unsqueeze(-1)
        err = block_sum((x - e2m1_round(x / sg) * sg).square())
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_code = torch.where(better, code, best_code)
    return best_code.to(torch.uint8).view(torch.float8_e4m3fn)


def _quantize_blocks_mse(blocks: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_blocks` with the block scales of :func:`mse_block_scales`."""
    x = blocks.float()
    s8 = mse_block_scales(x, g)
    return _pack_codes(x, s8, g), s8


def _quantize_blocks_with_scales(blocks: torch.Tensor, s8: torch.Tensor, g: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_blocks` under given block scales ``s8`` (float8_e4m3fn ``[rows, n]``)."""
    return _pack_codes(blocks.float(), s8, g), s8


# Same compile rules as KERNEL (one compile per input width; G4_NVFP4_EAGER=1 or a failure: eager).
MSE_KERNEL = CompiledKernel(_quantize_blocks_mse, eager_env="G4_NVFP4_EAGER", label="NVFP4 mse", rows_dynamic=True,
                            packaged_by="g4convert kernels SRC --algorithm mse")
BLOCK_METHODS = ("max", "mse")
_KERNELS = {"max": (KERNEL, _quantize_blocks), "mse": (MSE_KERNEL, _quantize_blocks_mse)}
# The mse kernel on contiguous bf16 weights in nvfp4_native.c: the arithmetic of _quantize_blocks_mse in
# the same order (block_sum's for the errors), 16 blocks at a time with AVX-512 (one block at a time
# with AVX2), a candidate skipped only where it provably cannot win: 233-254 Melem/s with AVX-512
# against the compiled kernel's 41-45 in this order (84-89 in torch's sum(-1)), 106-107 with AVX2,
# on 8 experts [1408, 2816] / [2816, 704] bf16, 2 threads (bench/bench_quantizer.py, 2026-12-07);
# the same bytes. Built, cached and checked as NATIVE.
NATIVE_MSE = NativeKernel("nvfp4_native.c", "g4_nvfp4_mse_bf16", NATIVE.argtypes, ctypes.c_int, label="NVFP4 mse",
                          eager_env="G4_NVFP4_EAGER",
                          check=functools.partial(_native_gives_eager_bytes, eager=_quantize_blocks_mse),
                          min_elements=MSE_KERNEL.min_elements)
_NATIVE = {"max": NATIVE, "mse": NATIVE_MSE}


def quantize(
    w: torch.Tensor,
    weight_scale_2: torch.Tensor | None = None,
    *,
    method: str = "max",
) -> NVFP4Weight:
    """Quantize one 2-D weight to NVFP4 exactly as modelopt's HF export does.

    Args:
        w: ``[out, in]`` bf16/fp16/fp32 weight, ``in % 16 == 0``. Not modified.
        weight_scale_2: float32 ``[]`` global scale to use. Pass the shared value for
            fused groups (an expert's gate/up from the whole ``gate_up_proj[e]``;
            dense q/k/v and gate/up from the max amax over the group). ``None``
            computes ``amax(|w|) / 2688``. A zero global scale (all-zero tensor or
            group) is replaced by ``1 / 2688`` so that no scale is NaN or 0.
        method: block scales: ``"max"`` (modelopt's default, ``amax_block / (6 g)``) or
            ``"mse"`` (the E4M3 scale minimising each block's squared error, modelopt's
            ``mse`` with ``fp8_scale_sweep``; see :data:`MSE_CODE_OFFSETS`).

    Returns:
        :class:`NVFP4Weight` with ``weight`` uint8 ``[out, in/2]``, ``weight_scale``
        float8_e4m3fn ``[out, in/16]``, ``weight_scale_2`` float32 ``[]``.

    Raises:
        ValueError: ``w`` is not 2-D, ``in`` is not a multiple of 16, the global
            scale is negative, not finite, or 0 for a non-zero ``w``, or an unknown ``method``.
    """
    if method not in _KERNELS:
        raise ValueError(f"unknown NVFP4 block-scale method {method!r}; choose one of {', '.join(BLOCK_METHODS)}")
    if w.dim() != 2:
        raise ValueError(f"NVFP4 quantizes 2-D weights, got shape {tuple(w.shape)}")
    out_features, in_features = w.shape
    if in_features % BLOCK_SIZE:
        raise ValueError(f"input dimension {in_features} is not a multiple of the NVFP4 block size {BLOCK_SIZE}")
    if weight_scale_2 is None:
        weight_scale_2 = global_scale_from_amax(weight_amax(w))
    g = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(())
    if not (torch.isfinite(g) and g >= 0):
        raise ValueError(f"NVFP4 global scale must be finite and >= 0, got {g.item()}")
    if g == 0:
        # An all-zero tensor (or fused group): modelopt would compute 0/0 = NaN block
        # scales. Write amax := 1 instead; codes are 0 and dequantize to exact zeros.
        if w.any():
            raise ValueError("NVFP4 global scale is 0 but the weight is not all zero")
        g = global_scale_from_amax(1.0)

    packed, scales = _quantize_2d(w, g, method)
    return NVFP4Weight(packed, scales, g.clone())


# The max kernel is given every weight as ``[blocks / 4, 4, 16]`` where the blocks of a row are a
# multiple of 4 (every Gemma 4 width: 2816, 4096, 8192, 2112, 704), so one compiled graph serves
# every width (a compile is 0.25-0.4 s even from inductor's cache, and a conversion's kernels are
# compiled before its layer loop can start); its arithmetic is per 16-element block, so the bytes
# are the same. The 26B-A4B gate_up layer ran at 581 Melem/s so against 585 in the rows' own
# shape (2 threads, 2026-12-06). The mse kernel keeps the rows' shape: folded, inductor's code
# for its 33-scale search ran 20-50x slower.
_MAX_FOLD = 4


def _kernel_blocks(blocks: torch.Tensor, method: str) -> torch.Tensor:
    """The view of ``blocks`` ``[rows, n, 16]`` that ``method``'s compiled kernel is given (its
    static sizes pick the compiled graph): ``[rows * n / 4, 4, 16]`` for ``max`` where ``n % 4 == 0``
    (:data:`_MAX_FOLD`), else ``blocks``."""
    if method == "max" and blocks.shape[1] % _MAX_FOLD == 0:
        return blocks.reshape(-1, _MAX_FOLD, BLOCK_SIZE)
    return blocks


def _quantize_2d(w: torch.Tensor, g: torch.Tensor, method: str = "max",
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8 ``[rows, in/2]``) and block scales (float8_e4m3fn ``[rows, in/16]``) of ``w``
    ``[rows, in]`` under ``g`` (``[]``, > 0), written into ``out`` where given (contiguous tensors
    of those shapes and dtypes). Kernels in order: the native one (contiguous bf16,
    :data:`NATIVE` / :data:`NATIVE_MSE`), the compiled one, the eager chunks: the same bytes."""
    kernel, eager = _KERNELS[method]
    out_features, in_features = w.shape
    w = w.contiguous()  # a transposed or sliced weight: every kernel reads whole rows of 16-element blocks
    native = None
    if w.dtype == torch.bfloat16 and w.device.type == "cpu":
        native = _NATIVE[method].for_size(w.numel())
        g_value = float(g) if native is not None else 0.0
        if not (math.isfinite(g_value) and g_value > 0):  # the C kernel's contract; the others give NaN bytes
            native = None
    if native is not None:
        packed, scales = out if out is not None else _empty_result(out_features, in_features)
        try:
            native_call(native, w, g_value, packed, scales, torch.get_num_threads())
            return packed, scales
        except (ctypes.ArgumentError, TypeError) as e:
            _NATIVE[method].disable(e)
    blocks = w.reshape(out_features, in_features // BLOCK_SIZE, BLOCK_SIZE)
    fused = kernel.for_size(w.numel())
    if fused is not None:
        try:
            packed, scales = fused(_kernel_blocks(blocks, method), g)
            packed = packed.view(out_features, in_features // 2)
            scales = scales.view(out_features, in_features // BLOCK_SIZE)
            if out is None:
                return packed, scales
            out[0].copy_(packed), out[1].copy_(scales)
            return out
        except Exception as e:  # noqa: BLE001 - inductor raises many types (no compiler, codegen)
            kernel.disable(e)
    packed, scales = out if out is not None else _empty_result(out_features, in_features)
    rows = max(1, _ROW_CHUNK_ELEMENTS // in_features)
    for r0 in range(0, out_features, rows):
        packed[r0 : r0 + rows], scales[r0 : r0 + rows] = eager(blocks[r0 : r0 + rows], g)
    return packed, scales


def _empty_result(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(out_features, in_features // 2, dtype=torch.uint8),
            torch.empty(out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn))


def warm(shapes: Iterable[tuple[int, int, torch.dtype]], method: str = "max") -> threading.Thread | None:
    """Compile, in a background thread, the kernel that :func:`quantize` / :func:`quantize_experts`
    with ``method`` will run on 2-D weights (one expert's for the experts) of each ``(out, in, dtype)``
    in ``shapes`` (in the order of first use): one compile per input width (max: per
    :func:`_kernel_blocks` view, one for most widths) and dtype, for the
    shapes the kernel is used for (:class:`g4.quantizers.compiled.CompiledKernel`, ``min_elements``),
    on a few rows of zeros marked dynamic as the real call marks them. Returns the thread, or None
    (:meth:`~g4.quantizers.compiled.CompiledKernel.warm`). The bytes are the same with or without it.
    The shapes the native kernel takes (:data:`NATIVE`, :data:`NATIVE_MSE`: bf16) are not compiled where it
    loads (here, before the thread starts: built once per machine in about 0.3 s, then loaded in
    milliseconds).

    Raises:
        ValueError: an unknown ``method``.
    """
    return _KERNELS[method][0].warm_rows(_kernel_inputs(_compiled_shapes(shapes, method), method),
                                         torch.ones((), dtype=torch.float32))


def save_kernels(shapes: Iterable[tuple[int, int, torch.dtype]], method: str = "max") -> list[tuple[Path, float | None]]:
    """Put into the kernel cache the kernels a conversion with ``method`` runs on ``shapes``:
    the native library (:data:`NATIVE` for ``max``, :data:`NATIVE_MSE` for ``mse``, where it
    builds here and gives the eager bytes, unless this process has turned it off), and a package
    (:meth:`g4.quantizers.compiled.CompiledKernel.save_packages`) for each shape :func:`warm`
    would compile; later processes load them in milliseconds. Returns ``(path, compile seconds
    or None where cached)`` per library or package.

    Raises:
        ValueError: an unknown ``method``, or the kernel cache is off.
        PackageCompileError, PermissionError, RuntimeError: as
            :meth:`~g4.quantizers.compiled.CompiledKernel.save_packages` raises them.
    """
    shapes = list(shapes)
    done = []
    native = _native_for(shapes, method)
    if native is not None and native.function is not None:
        try:
            saved = native.save()
        except NativeBuildError:  # no compiler, or neither AVX-512 nor AVX2 here: the compiled kernel serves
            pass
        else:
            if native.load() is not None:
                done.append(saved)
    return done + _KERNELS[method][0].save_packages(_kernel_inputs(_compiled_shapes(shapes, method), method),
                                                    torch.ones((), dtype=torch.float32))


def _compiled_shapes(shapes: Iterable[tuple[int, int, torch.dtype]], method: str) -> list[tuple[int, int, torch.dtype]]:
    """``shapes`` less those the native kernel takes where it loads (bf16)."""
    shapes = list(shapes)
    native = _native_for(shapes, method)
    if native is not None and native.for_size(native.min_elements):
        shapes = [s for s in shapes if s[2] != torch.bfloat16]
    return shapes


def _native_for(shapes: list[tuple[int, int, torch.dtype]], method: str) -> NativeKernel | None:
    """``method``'s native kernel where a bf16 weight of ``shapes`` (``(out, in, dtype)``) is large
    enough for it, else None (then nothing builds it)."""
    native = _NATIVE.get(method)
    if native is not None and any(d == torch.bfloat16 and out * k >= native.min_elements for out, k, d in shapes):
        return native
    return None


def _kernel_inputs(shapes: Iterable[tuple[int, int, torch.dtype]], method: str
                   ) -> Iterator[tuple[int, tuple[int, ...], torch.dtype]]:
    """``(numel, shape without the rows, dtype)`` of the kernel's first argument for each 2-D
    weight ``(out, in, dtype)`` (:func:`_kernel_blocks`' view)."""
    if method not in _KERNELS:
        raise ValueError(f"unknown NVFP4 block-scale method {method!r}; choose one of {', '.join(BLOCK_METHODS)}")
    return ((out * k, _kernel_blocks(torch.empty(0, k // BLOCK_SIZE, BLOCK_SIZE), method).shape[1:], dtype)
            for out, k, dtype in shapes if k % BLOCK_SIZE == 0)


def quantize_experts(w: torch.Tensor, *, method: str = "max", amax: torch.Tensor | None = None) -> NVFP4Weight:
    """:func:`quantize` of every ``w[e]`` with its own global scale ``amax(|w[e]|) / 2688``.

    Same bytes as ``quantize(w[e])`` for each e (an all-zero expert gets ``1 / 2688``): one
    kernel call per expert with its 0-d global scale (one call for all experts with a per-row
    scale was as fast with the midpoint count, and 3.5x slower with :func:`_e2m1_codes`' form).

    Args:
        w: ``[E, out, in]`` bf16/fp16/fp32, ``in % 16 == 0`` (e.g. a fused ``gate_up_proj``,
            whose gate and up rows then share their expert's global scale, as vLLM needs).
        method: block scales, ``"max"`` or ``"mse"`` as in :func:`quantize`.
        amax: fp32 ``[E]``, ``max(|w[e]|)`` of each expert where the caller has it already (the
            conversion's reading thread computes it as its NaN/Inf check,
            :func:`g4.core.checkpoint.finite_amax`); None: computed here (:func:`weight_amax`).

    Returns:
        :class:`NVFP4Weight` with ``weight`` uint8 ``[E, out, in/2]``, ``weight_scale``
        float8_e4m3fn ``[E, out, in/16]``, ``weight_scale_2`` float32 ``[E]``.

    Raises:
        ValueError: ``w`` is not 3-D or ``in`` is not a multiple of 16.
    """
    if w.dim() != 3 or w.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"NVFP4 experts need [E, out, in] with in % {BLOCK_SIZE} == 0, got {tuple(w.shape)}")
    n_exp, out_features, in_features = w.shape
    # one whole-tensor aminmax per expert: torch's aminmax(dim=1) over [E, out*in] runs 6-7x
    # slower on the CPU (526 vs 78 ms for a 26B-A4B gate_up layer [128, 1408, 2816], 2 threads)
    if amax is None:
        amax = torch.stack([weight_amax(w[e]) for e in range(n_exp)])
    elif amax.shape != (n_exp,):
        raise ValueError(f"NVFP4 experts: amax of shape {tuple(amax.shape)} for {n_exp} experts")
    g = amax.float() / NVFP4_SCALE_DENOM
    g = torch.where(g == 0, global_scale_from_amax(1.0), g)
    packed = torch.empty(n_exp, out_features, in_features // 2, dtype=torch.uint8)
    scales = torch.empty(n_exp, out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn)
    for e in range(n_exp):
        _quantize_2d(w[e], g[e], method, out=(packed[e], scales[e]))
    return NVFP4Weight(packed, scales, g)


def quantize_with_scales(w: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> NVFP4Weight:
    """NVFP4 codes of ``w`` under block scales chosen elsewhere (GPTQ sets them group by group).

    Args:
        w: ``[out, in]`` float weight (``in % 16 == 0``), e.g. the values GPTQ quantized.
        weight_scale: float8_e4m3fn ``[out, in/16]``, positive finite.
        weight_scale_2: float32 ``[]`` global scale, > 0.

    Returns:
        :class:`NVFP4Weight` holding those scales and the codes of ``w`` under them.
    """
    out_features, in_features = w.shape
    blocks = w.reshape(out_features, in_features // BLOCK_SIZE, BLOCK_SIZE)
    g = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(())
    packed, s8 = _quantize_blocks_with_scales(blocks, weight_scale, g)
    return NVFP4Weight(packed, s8, g.clone())


def dequantize(q: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``[out, in]`` weights: ``e2m1[code] * float32(weight_scale) * weight_scale_2``.

    Args:
        q: quantized weight.
        dtype: output dtype; the product is formed in fp32 and cast once.

    Returns:
        ``[out, in]`` tensor of ``dtype``.
    """
    return dequantize_tensors(q.weight, q.weight_scale, q.weight_scale_2, dtype)


def dequantize_tensors(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`dequantize` on the three raw checkpoint tensors (uint8, float8_e4m3fn, float32)."""
    out_features, half = weight.shape
    codes = torch.stack((weight & 0x0F, weight >> 4), dim=-1).reshape(out_features, half * 2)
    values = E2M1_VALUES[codes.long()]
    blocks = values.reshape(out_features, -1, BLOCK_SIZE)
    scale = weight_scale.float() * weight_scale_2.float()
    return (blocks * scale.unsqueeze(-1)).reshape(out_features, half * 2).to(dtype)


def fake_quantize_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 W4A4 activation fake-quant as vLLM's emulation does it: dynamic fp8 block
    scales over 16-element blocks of the last dim against the static global ``input_scale``.

    Args:
        x: ``[..., K]`` activations, ``K % 16 == 0``.
        input_scale: float32 ``[]``, ``amax / 2688`` from calibration.

    Returns:
        Tensor like ``x`` (same dtype) holding the quantize-dequantize result.
    """
    shape, dtype = x.shape, x.dtype
    q = quantize(x.reshape(-1, shape[-1]), weight_scale_2=input_scale)
    return dequantize(q, dtype).reshape(shape)
