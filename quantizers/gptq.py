"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") for NVFP4 and per-channel int8 weights.

The weight is quantized one input column at a time, in order; after each column the
rounding error, weighted by the inverse Hessian ``H^-1`` of the layer's inputs
(``H = X^T X`` over the calibration tokens that reached the linear), is spread over the
columns not yet quantized, which minimises ``||X W^T - X Q^T||^2`` column by column
(the "lazy batch" and Cholesky form of the paper, as in IST-DASLab/gptq ``gptq.py`` and
vllm-project/llm-compressor ``modifiers/quantization/gptq/gptq_quantize.py``).

NVFP4 specifics (as llm-compressor's GPTQ with the ``tensor_group`` strategy, group size 16):
the global scale ``weight_scale_2`` is fixed from the original weight before the pass
(``amax / 2688``, shared over a fused group exactly as for ``max``); the E4M3 scale of each
16-column block is chosen when GPTQ reaches the block's first column, from the columns as
the earlier errors have updated them (with :mod:`g4.quantizers.nvfp4`'s ``max`` or ``mse``
block-scale rule), so it sees the weights it will quantize.
int8: the per-output-channel scale ``absmax / 127`` of the original row is fixed first
(as NxD's observer sets it), then the columns are rounded ``round_half_even(w / scale)``.

Inputs with ``H[i, i] == 0`` (no calibration signal) get ``H[i, i] = 1`` and their weight
column is quantized as is; ``damp * mean(diag(H))`` is added to the diagonal (default 1%, as
both references); a Hessian whose Cholesky factorisation still fails is retried with 10x
the damping, up to 3 times. Everything is computed in fp32 and batched over a leading
expert dimension.
"""

from __future__ import annotations

import torch

from g4.quantizers import int8 as q8, nvfp4 as q4

DEFAULT_DAMP = 0.01
# Columns updated together before the error is pushed to the rest with one matmul (a
# multiple of the NVFP4 block); 128 as in both references.
LAZY_BLOCK = 128
# gptq_int8: fp32 weight elements taken per step (rows are independent under per-channel scales)
ROW_STEP_ELEMENTS = 1 << 24


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1`` (fp32 ``[E, in, in]``) and
    the bool ``[E, in]`` mask of dead inputs (``H[i, i] == 0``)."""
    h = h.float().clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    dead = diag == 0
    diag[dead] = 1.0
    mean = diag.mean(-1, keepdim=True)
    for attempt in range(4):
        hd = h.clone()
        torch.diagonal(hd, dim1=-2, dim2=-1).add_(damp * 10**attempt * mean)
        lower, info = torch.linalg.cholesky_ex(hd)
        if not info.any():
            break
    else:
        raise ValueError("GPTQ: the Hessian is not positive definite even with 1000x the damping")
    inv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(inv, upper=True), dead


def _gptq_columns(w: torch.Tensor, u: torch.Tensor, start_group, quant_column):
    """The GPTQ column loop on ``w`` ``[E, out, in]`` (fp32, updated in place) with ``u`` the
    upper Cholesky factors ``[E, in, in]`` of the damped inverse Hessians
    (:func:`_inverse_hessian_factor`). ``start_group(i, cols)`` is called at every 16th column ``i`` with the
    current ``[E, out, 16]`` columns (NVFP4 block scales; int8 ignores it) and ``quant_column(i,
    col)`` returns the dequantized column ``[E, out]``. Returns the columns as they were
    quantized (``[E, out, in]``: re-quantizing them reproduces the codes)."""
    n_in = w.shape[-1]
    seen = torch.empty_like(w)
    for i1 in range(0, n_in, LAZY_BLOCK):
        i2 = min(i1 + LAZY_BLOCK, n_in)
        w1 = w[..., i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % q4.BLOCK_SIZE == 0:
                start_group(col, w1[..., i : i + q4.BLOCK_SIZE])
            x = w1[..., i]
            seen[..., col] = x
            e = (x - quant_column(col, x)) / u1[:, i, i].unsqueeze(-1)
            w1[..., i:] -= e.unsqueeze(-1) * u1[:, i, i:].unsqueeze(1)
            err1[..., i] = e
        w[..., i1:i2] = w1
        if i2 < n_in:
            w[..., i2:] -= torch.bmm(err1, u[:, i1:i2, i2:])
    return seen


def gptq_nvfp4(w: torch.Tensor, h: torch.Tensor, weight_scale_2: torch.Tensor, *, block_scales: str = "mse",
               damp: float = DEFAULT_DAMP) -> q4.NVFP4Weight:
    """NVFP4 codes and block scales of ``w`` chosen by GPTQ under a fixed global scale.

    Args:
        w: ``[out, in]`` or ``[E, out, in]`` float weight, ``in % 16 == 0``. Not modified.
        h: fp32 ``[in, in]`` or ``[E, in, in]``: ``sum x^T x`` over the calibration inputs
            of the linear (of expert e); any positive multiple gives the same result.
        weight_scale_2: float32 ``[]`` or ``[E]`` global scale(s), > 0 (e.g. ``amax / 2688``
            of the original weight, or shared over a fused group).
        block_scales: how each 16-column block's E4M3 scale is chosen from the updated
            columns: ``"mse"`` (least squared error) or ``"max"``.
        damp: fraction of the mean Hessian diagonal added to the diagonal.

    Returns:
        :class:`g4.quantizers.nvfp4.NVFP4Weight` shaped like the input (``[E, ...]`` tensors
        and ``weight_scale_2`` ``[E]`` for a 3-D ``w``).

    Raises:
        ValueError: shapes that disagree, ``in % 16 != 0``, an unknown ``block_scales``, or a
            Hessian that no damping makes positive definite.
    """
    squeeze = w.dim() == 2
    w3, h3 = (w.unsqueeze(0), h.unsqueeze(0)) if squeeze else (w, h)
    n_exp, out_features, in_features = w3.shape
    if in_features % q4.BLOCK_SIZE or h3.shape != (n_exp, in_features, in_features):
        raise ValueError(f"GPTQ NVFP4: weight {tuple(w.shape)} and Hessian {tuple(h.shape)} do not fit "
                         f"(in % {q4.BLOCK_SIZE} == 0, Hessian [.., in, in])")
    if block_scales not in ("max", "mse"):
        raise ValueError(f"GPTQ NVFP4: unknown block_scales {block_scales!r}")
    g = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(n_exp)
    pick = q4.mse_block_scales if block_scales == "mse" else q4.max_block_scales
    scales = torch.empty(n_exp, out_features, in_features // q4.BLOCK_SIZE, dtype=torch.float8_e4m3fn)
    sg = torch.empty(n_exp, out_features)

    def start_group(col, cols):
        b = col // q4.BLOCK_SIZE
        for e in range(n_exp):  # block-scale rules take one 0-d global scale
            scales[e, :, b] = pick(cols[e].unsqueeze(1), g[e]).squeeze(1)
        sg.copy_(scales[..., b].float() * g.view(n_exp, 1))

    def quant_column(col, x):
        return q4.e2m1_round(x / sg) * sg

    seen = _gptq_columns(w3.float().clone(), _inverse_hessian_factor(h3, damp)[0], start_group, quant_column)
    packed = torch.empty(n_exp, out_features, in_features // 2, dtype=torch.uint8)
    for e in range(n_exp):
        packed[e] = q4.quantize_with_scales(seen[e], scales[e], g[e]).weight
    if squeeze:
        return q4.NVFP4Weight(packed[0], scales[0], g[0].clone())
    return q4.NVFP4Weight(packed, scales, g.clone())


def gptq_int8(w: torch.Tensor, h: torch.Tensor, *, damp: float = DEFAULT_DAMP) -> q8.Int8Weight:
    """Per-output-channel symmetric int8 of ``w`` by GPTQ, scales fixed from the original rows.

    Args:
        w: ``[out, in]`` or ``[E, out, in]`` float weight. Not modified.
        h: fp32 ``[in, in]`` or ``[E, in, in]`` input Hessian(s) as for :func:`gptq_nvfp4`.
        damp: fraction of the mean Hessian diagonal added to the diagonal.

    Returns:
        :class:`g4.quantizers.int8.Int8Weight`: int8 shaped like ``w`` and float32 scales
        ``[..., out, 1]`` equal to :func:`g4.quantizers.int8.quantize`'s.

    Memory: the inverse-Hessian factor (``4 * E * in**2`` bytes) once, and the rows in steps of
    about ``ROW_STEP_ELEMENTS`` fp32 elements (three fp32 copies of a step): with per-channel
    scales every output row is quantized on its own (the error of a row is spread over that
    row's later columns only), so a large weight such as a ``[262144, 2816]`` lm_head needs no
    fp32 copy of the whole tensor. Steps change only the matmuls' summation order (measured: 1
    code in 230k off by one against a single pass); the result is deterministic for a shape.

    Raises:
        ValueError: shapes that disagree, or a Hessian no damping makes positive definite.
    """
    squeeze = w.dim() == 2
    w3, h3 = (w.unsqueeze(0), h.unsqueeze(0)) if squeeze else (w, h)
    n_exp, out_features, in_features = w3.shape
    if h3.shape != (n_exp, in_features, in_features):
        raise ValueError(f"GPTQ int8: weight {tuple(w.shape)} and Hessian {tuple(h.shape)} do not fit")
    u, _ = _inverse_hessian_factor(h3, damp)
    qw = torch.empty(w3.shape, dtype=torch.int8)
    scale = torch.empty(n_exp, out_features, 1, dtype=torch.float32)
    rows = max(1, ROW_STEP_ELEMENTS // (n_exp * in_features))
    for r0 in range(0, out_features, rows):
        x = w3[:, r0 : r0 + rows].float()
        s = q8.channel_scale(x)  # [E, rows, 1], NxD's
        inv, sq = s.reciprocal(), s.squeeze(-1)

        def quant_column(col, c, inv=inv.squeeze(-1), sq=sq):
            return torch.round(c * inv).clamp(-128, 127) * sq

        seen = _gptq_columns(x.clone(), u, lambda col, cols: None, quant_column)
        qw[:, r0 : r0 + rows] = torch.round(seen * inv).clamp(-128, 127).to(torch.int8)
        scale[:, r0 : r0 + rows] = s
    return q8.Int8Weight(qw[0], scale[0]) if squeeze else q8.Int8Weight(qw, scale)
