"""int8 per-channel symmetric weight quantization as AWS neuronx-distributed does it.

Reference: NxD/NxDI quantize on the CPU
with ``PerChannelAbsMaxObserver(dtype=qint8, qscheme=per_channel_symmetric, ch_axis=0)``
(aws-neuron/neuronx-distributed ``src/neuronx_distributed/quantization/observer.py``,
``quantization_utils.py:quantize_pytorch_model_per_channel_symmetric``):

- ``scale = max(absmax over the input dim / 127, float32 eps)``, fp32, one per output channel;
- ``q = clamp(round_half_even(w * fp32(1 / scale)), -128, 127)``, int8 (in practice within ±127):
  the observer's scale goes to ``torch.quantize_per_channel``, whose CPU kernel multiplies by the
  fp32 reciprocal of the scale (pytorch/pytorch ``aten/src/ATen/native/quantized/AffineQuantizer``
  ``quantize_val``: ``nearbyint(value * (1.0f / scale))``); dividing by the scale instead
  differs by 1 where ``w / scale`` is within an ulp of a half-way point (``absmax / 2``);
- the layer computes ``y = (x @ q.T) * scale.T`` (dequantize after the matmul, in fp32).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.quantizers.compiled import CompiledKernel

INT8_QMAX = 127.0
SCALE_EPS = torch.finfo(torch.float32).eps
# Output channels quantized per step, bounding fp32 temporaries on large tensors.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Int8Weight:
    """A weight quantized per output channel.

    Attributes:
        weight: int8 ``[..., out, in]`` (same layout as the input; :func:`quantize_to_layout`: its layout).
        scale: float32 ``[..., out, 1]``, ``absmax / 127`` per output channel (floored at eps).
    """

    weight: torch.Tensor
    scale: torch.Tensor


def channel_scale(x: torch.Tensor) -> torch.Tensor:
    """NxD's per-channel scale of fp32 ``x`` ``[..., out, in]``: fp32 ``[..., out, 1]``,
    ``max(absmax over in / 127, eps)`` (also the fixed scale of :func:`g4.quantizers.gptq.gptq_int8`)."""
    return (x.abs().amax(-1, keepdim=True) / INT8_QMAX).clamp(min=SCALE_EPS)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``[rows, in]`` and fp32 scales ``[rows, 1]`` of ``x`` ``[rows, in]`` (any float dtype):
    the one definition of the arithmetic, run eagerly on row chunks or compiled whole."""
    x = x.float()
    s = channel_scale(x)
    return torch.round(x * s.reciprocal()).clamp(-128, 127).to(torch.int8), s


# As in g4.quantizers.nvfp4: _quantize_rows compiled by torch.compile (inductor) into one
# pass, static in the input width, dynamic in the rows; small tensors,
# G4_INT8_EAGER=1 or a compile/run failure use the eager chunks (same bytes; tests check both).
KERNEL = CompiledKernel(_quantize_rows, eager_env="G4_INT8_EAGER", label="int8", rows_dynamic=True,
                        packaged_by="g4convert kernels SRC --format int8-neuron --tp T")


def quantize(w: torch.Tensor) -> Int8Weight:
    """Quantize ``w`` per output channel; the input dimension is the last one.

    Args:
        w: ``[..., out, in]`` bf16/fp16/fp32 (e.g. ``[out, in]`` linears or
            ``[E, out, in]`` experts in the Hugging Face layout). Not modified.

    Returns:
        :class:`Int8Weight` with int8 ``[..., out, in]`` and fp32 ``[..., out, 1]``.

    Raises:
        ValueError: ``w`` has fewer than 2 dims or holds NaN/Inf.
    """
    if w.dim() < 2:
        raise ValueError(f"int8 per-channel quantization needs [..., out, in], got shape {tuple(w.shape)}")
    flat = w.reshape(-1, w.shape[-1])
    fused = KERNEL.for_size(flat.numel())
    if fused is not None:
        try:
            q, scale = fused(flat)
        except Exception as e:  # noqa: BLE001 - inductor raises many types (no compiler, codegen)
            KERNEL.disable(e)
            fused = None
        else:
            if not torch.isfinite(scale).all():
                raise ValueError("int8 quantization: weight holds NaN/Inf")
    if fused is None:
        q = torch.empty(flat.shape, dtype=torch.int8)
        scale = torch.empty(flat.shape[0], 1, dtype=torch.float32)
        rows = max(1, _CHUNK_ELEMENTS // flat.shape[1])
        for r0 in range(0, flat.shape[0], rows):
            q[r0 : r0 + rows], scale[r0 : r0 + rows] = _quantize_rows(flat[r0 : r0 + rows])
            if not torch.isfinite(scale[r0 : r0 + rows]).all():
                raise ValueError("int8 quantization: weight holds NaN/Inf")
    return Int8Weight(q.reshape(w.shape), scale.reshape(*w.shape[:-1], 1))


def warm(shapes: Iterable[tuple[int, int, torch.dtype]]) -> threading.Thread | None:
    """Compile, in a background thread, the kernel :func:`quantize` will run on weights of each
    ``(rows, in, dtype)`` of ``shapes`` (rows: the product of the leading dimensions; in the order
    of first use): one compile per input width and dtype, for the shapes the kernel is used for,
    on a few rows of zeros marked dynamic as :func:`quantize` marks them (as
    :func:`g4.quantizers.nvfp4.warm`). :func:`quantize_to_layout`'s kernels are static in every
    dimension and are compiled on first use. Returns the thread, or None; the bytes are the same."""
    return KERNEL.warm_rows((rows * k, (k,), dtype) for rows, k, dtype in shapes)


def save_kernels(shapes: Iterable[tuple[int, int, torch.dtype]],
                 layouts: Iterable[tuple[Hashable, tuple[int, ...], torch.dtype]] = ()
                 ) -> list[tuple[Path, float | None]]:
    """Package into the kernel cache the kernels :func:`warm` would compile for ``shapes``, and
    :func:`quantize_to_layout`'s for each ``(layout, shape, dtype)`` of ``layouts``
    (:meth:`g4.quantizers.compiled.CompiledKernel.save_packages`). Returns ``(path, compile
    seconds or None where cached)`` per package.

    Raises:
        ValueError: the kernel cache is off.
        PackageCompileError, PermissionError, RuntimeError: as
            :meth:`~g4.quantizers.compiled.CompiledKernel.save_packages` raises them.
    """
    done = KERNEL.save_packages((rows * k, (k,), dtype) for rows, k, dtype in shapes)
    for layout, shape, dtype in dict.fromkeys(layouts):
        done += _layout_kernel(layout).save_packages([(math.prod(shape), tuple(shape[1:]), dtype)])
    return done


# One compiled kernel per layout given to quantize_to_layout (the layout is its key).
_LAYOUT_KERNELS: dict[Hashable, CompiledKernel] = {}


def _layout_kernel(layout: Callable[[torch.Tensor], torch.Tensor]) -> CompiledKernel:
    """:func:`quantize_to_layout`'s kernel for ``layout`` (made on first use): static in every
    dimension under torch.compile; its cached package is keyed by the layout's ``repr`` and source."""
    kernel = _LAYOUT_KERNELS.get(layout)
    if kernel is None:
        def laid_out(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, s = _quantize_rows(x)
            return layout(q), s

        kernel = _LAYOUT_KERNELS[layout] = CompiledKernel(laid_out, eager_env="G4_INT8_EAGER", label="int8 layout",
                                                          key=repr(layout), sources=(layout,), packaged_by=KERNEL.packaged_by)
    return kernel


def quantize_to_layout(w: torch.Tensor, layout: Callable[[torch.Tensor], torch.Tensor]) -> Int8Weight:
    """:func:`quantize`, with the int8 codes written straight into another layout in the same
    pass: one compiled kernel reads ``w`` once and stores ``layout(codes)`` (no full-size codes in
    the input's layout, no second copy); the eager path (small tensors, ``G4_INT8_EAGER=1``, a
    compile or run failure) computes :func:`quantize` and then ``layout``: the same bytes.

    Args:
        w: ``[..., out, in]`` bf16/fp16/fp32 (not modified).
        layout: a hashable callable (equal values: the same function) that takes int8 codes
            ``[..., out, in]`` and returns them rearranged, contiguous (a permutation of whole
            dimensions, e.g. every TP rank's share of an expert weight,
            ``g4.exporters.neuron_int8.RankMajor``); compiled once per value and input shape.

    Returns:
        :class:`Int8Weight` whose ``weight`` is ``layout(codes)`` (int8) and whose ``scale`` is
        fp32 ``[..., out, 1]`` in ``w``'s layout.

    Raises:
        ValueError: ``w`` has fewer than 2 dims or holds NaN/Inf.
    """
    if w.dim() < 2:
        raise ValueError(f"int8 per-channel quantization needs [..., out, in], got shape {tuple(w.shape)}")
    kernel = _layout_kernel(layout)
    fused = kernel.for_size(w.numel())
    if fused is not None:
        try:
            q, scale = fused(w)
        except Exception as e:  # noqa: BLE001 - inductor raises many types (no compiler, codegen)
            kernel.disable(e)
        else:
            if not torch.isfinite(scale).all():
                raise ValueError("int8 quantization: weight holds NaN/Inf")
            return Int8Weight(q, scale)
    res = quantize(w)
    return Int8Weight(layout(res.weight), res.scale)


def dequantize(q: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.weight * q.scale`` in fp32, cast to ``dtype``; shape ``[..., out, in]``."""
    return (q.weight.float() * q.scale).to(dtype)
