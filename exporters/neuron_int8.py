"""Per-TP-rank slices of int8-neuron tensors (layout: ``g4.serve.neuron_layout``).

Slicing follows aws-neuron/neuronx-distributed ``trace/trace.py:create_local_weight``
and ``quantization/quantization_layers.py``: column layers split output
rows and their scales, row layers split input columns and replicate their scales, fused
expert gate/up is split with stride 2 (``[gate_r | up_r]``), expert down on its input
dim with the scale replicated. KV projections take whole KV heads, replicated when there
are fewer KV heads than ranks.
"""

from __future__ import annotations

import torch

from g4.quantizers.int8 import Int8Weight
from g4.serve.neuron_layout import COLUMN, EXPERT_DOWN, EXPERT_GATE_UP, REPLICATED, ROW, Entry, Geometry


def _column_rows(e: Entry, rows: int, g: Geometry, layer: int | None, rank: int) -> slice:
    if layer is not None and e.key in ("self_attn.k_proj", "self_attn.v_proj"):
        hd, n = g.head_dim[layer], g.kv_per_rank(layer)
        first = g.kv_head_of_rank(layer, rank)
        return slice(first * hd, (first + n) * hd)
    per = rows // g.tp
    return slice(rank * per, (rank + 1) * per)


def _gate_up_index(two_i: int, tp: int, rank: int) -> torch.Tensor:
    """Fused-row indices of rank ``rank``: its gate rows then its up rows (never a slice
    of the fused dimension; case P11)."""
    inter, per = two_i // 2, two_i // 2 // tp
    own = torch.arange(rank * per, (rank + 1) * per)
    return torch.cat([own, inter + own])


def shard(e: Entry, value: torch.Tensor | Int8Weight, g: Geometry, layer: int | None, rank: int
          ) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors of entry ``e``: ``[weight, scale]`` for int8 entries, else ``[tensor]``.

    Args:
        value: the full source tensor (Hugging Face layout) or its :class:`Int8Weight`
            (int8 ``[..., out, in]`` with fp32 ``[..., out, 1]`` scales).

    Returns:
        Contiguous tensors in the shapes :func:`g4.serve.neuron_layout.entry_specs` gives.
    """
    w, s = (value.weight, value.scale) if isinstance(value, Int8Weight) else (value, None)
    if e.rule == REPLICATED:
        parts = [w, s]
    elif e.rule == COLUMN:
        rows = _column_rows(e, w.shape[0], g, layer, rank)
        parts = [w[rows], None if s is None else s[rows]]
    elif e.rule == ROW:
        per = w.shape[1] // g.tp
        parts = [w[:, rank * per : (rank + 1) * per], s]
    elif e.rule == EXPERT_GATE_UP:  # HF [E, 2I, H] -> NxD [E, H, 2I/T]
        idx = _gate_up_index(w.shape[1], g.tp, rank)
        parts = [w[:, idx].transpose(1, 2), None if s is None else s[:, idx].transpose(1, 2)]
    elif e.rule == EXPERT_DOWN:  # HF [E, H, I] -> NxD [E, I/T, H]; scale [E, 1, H] replicated
        per = w.shape[2] // g.tp
        parts = [w[:, :, rank * per : (rank + 1) * per].transpose(1, 2), None if s is None else s.transpose(1, 2)]
    else:
        raise ValueError(f"unknown sharding rule {e.rule!r}")
    return [p.contiguous() for p in parts if p is not None]
