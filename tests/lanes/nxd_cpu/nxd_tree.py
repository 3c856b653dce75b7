"""NxD layers for g4's int8-neuron layout table, for the NxD CPU lane only (``worker.py``; never
imported by the pytest process, it needs NxD behind ``stubs.py``).

The layout table (``g4/exporters/neuron_int8.py``: each entry's rule and int8 flag) claims which
neuronx-distributed layer holds each tensor of a rank file and how NxD splits it. This module turns
that claim into NxD modules, so that NxD's own sharder (``trace/trace.py: get_sharded_checkpoint``)
and NxD's own forward can be run against g4's files:

- column rule (q, dense gate/up, lm_head) and KV-head rule: ``QuantizedColumnParallel``
  (``PER_CHANNEL_SYMMETRIC``, channel axis 0 passed as the enum's value, int8) or, unquantized,
  ``ColumnParallelLinear``;
- row rule (o_proj, dense down): ``QuantizedRowParallel`` / ``RowParallelLinear``, input parallel,
  output all-reduced;
- expert gate_up: ``QuantizedExpertFusedColumnParallel``, stride 2 (``[gate_r | up_r]``), expert-wise
  per-channel int8 scales ``[E, 1, out]`` (axis 2); expert down: ``QuantizedExpertFusedRowParallel``,
  ``reduce_output=False`` (the all-reduce follows the MoE combine);
- device embedding (hidden columns split): ``ParallelEmbedding(shard_across_embedding=True)``;
- rank index (``rank_util.rank``, ``moe.expert_mlps.spmd_rank.rank``): ``SPMDRank``, whose checkpoint
  value is ``arange(T)``;
- replicated tensors (norms, router, ``layer_scalar``): plain parameters.

Sources: aws-neuron/neuronx-distributed v2.28.0 ``src/neuronx_distributed/quantization/quantization_layers.py``,
``parallel_layers/layers.py``. (g4's serving path builds its NxD layers inside its NxDI class,
``g4/serve/nxdi_gemma4.py``, whose lane is ``tests/lanes/test_nxdi_gemma4.py``.)
"""

from __future__ import annotations

import torch
from torch import nn

from nxd_cpu.g4names import (
    COLUMN,
    EMBED_COLUMNS,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    KV_HEADS,
    RANK_INDEX,
    ROW,
    layer_entries,
    layer_prefix,
    model_entries,
)


class NxdLayers:
    """Factories of NxD's parallel layers with the constructor arguments the layout implies, for
    TP degree ``tp`` (NxD's parallel state must be initialised) and activation ``dtype``."""

    def __init__(self, tp: int, dtype: torch.dtype = torch.bfloat16):
        from neuronx_distributed.parallel_layers import layers
        from neuronx_distributed.quantization import quantization_config as qc
        from neuronx_distributed.quantization import quantization_layers as ql

        self.tp, self.dtype = tp, dtype
        self._layers, self._qc, self._ql = layers, qc, ql

    def _int8(self, axis: int, expert: bool) -> dict:
        qt = self._qc.QuantizationType
        return {"quantization_type": qt.EXPERT_WISE_PER_CHANNEL_SYMMETRIC if expert else qt.PER_CHANNEL_SYMMETRIC,
                "quantized_dtype": self._qc.QuantizedDtype.INT8, "quantization_per_channel_axis": axis,
                "dtype": self.dtype}

    def column(self, in_features: int, out_features: int, *, int8: bool, gather_output: bool = False):
        if int8:
            return self._ql.QuantizedColumnParallel(input_size=in_features, output_size=out_features, bias=False,
                                                    gather_output=gather_output, **self._int8(0, False))
        return self._layers.ColumnParallelLinear(in_features, out_features, bias=False, gather_output=gather_output,
                                                 dtype=self.dtype)

    def row(self, in_features: int, out_features: int, *, int8: bool):
        if int8:
            return self._ql.QuantizedRowParallel(input_size=in_features, output_size=out_features, bias=False,
                                                 input_is_parallel=True, reduce_output=True, **self._int8(0, False))
        return self._layers.RowParallelLinear(in_features, out_features, bias=False, input_is_parallel=True,
                                              dtype=self.dtype)

    def expert_gate_up(self, experts: int, hidden: int, intermediate: int):
        return self._ql.QuantizedExpertFusedColumnParallel(num_experts=experts, input_size=hidden,
                                                           output_size=2 * intermediate, stride=2,
                                                           **self._int8(2, True))

    def embedding(self, vocab: int, hidden: int):
        return self._layers.ParallelEmbedding(vocab, hidden, shard_across_embedding=True, dtype=self.dtype)

    def rank_index(self):
        return self._layers.SPMDRank(world_size=self.tp)

    def expert_down(self, experts: int, intermediate: int, hidden: int):
        return self._ql.QuantizedExpertFusedRowParallel(num_experts=experts, input_size=intermediate,
                                                        output_size=hidden, reduce_output=False,
                                                        **self._int8(2, True))


def layout_tree(full: dict[str, torch.Tensor], num_layers: int, has_v: list[bool], *, quantize_attention: bool,
                tied: bool, ops: NxdLayers) -> nn.Module:
    """One module whose ``state_dict()`` names are the rank-file keys of the layout table, each entry
    built as the NxD layer its rule names, sized from ``full`` (the unsharded TP-1 tensors, KV heads
    already replicated to the TP degree: NxD layout, ``weight [out, in]``, experts ``[E, H, 2I]`` /
    ``[E, I, H]``)."""
    root = nn.Module()
    placed = [(layer_prefix(L), e) for L in range(num_layers)
              for e in layer_entries(has_v=has_v[L], quantize_attention=quantize_attention)]
    placed += [("", e) for e in model_entries(tied=tied)]
    for prefix, e in placed:
        name = f"{prefix}{e.key}"
        if e.rule in (COLUMN, KV_HEADS, ROW):
            out_f, in_f = full[f"{name}.weight"].shape
            module = ops.row(in_f, out_f, int8=e.int8) if e.rule is ROW else ops.column(in_f, out_f, int8=e.int8)
        elif e.rule is EXPERT_GATE_UP:
            E, H, two_i = full[f"{name}.weight"].shape
            module = ops.expert_gate_up(E, H, two_i // 2)
        elif e.rule is EXPERT_DOWN:
            E, I, H = full[f"{name}.weight"].shape
            module = ops.expert_down(E, I, H)
        elif e.rule is EMBED_COLUMNS:
            V, H = full[f"{name}.weight"].shape
            module = ops.embedding(V, H)
        elif e.rule is RANK_INDEX:  # SPMDRank's parameter is "rank": the module sits one level up
            name = name.rpartition(".")[0]
            module = ops.rank_index()
        else:  # replicated: one tensor under key + suffix
            t = full[f"{name}{e.suffix}"]
            owner_name, attr = (name, e.suffix[1:]) if e.suffix else name.rsplit(".", 1) if "." in name else ("", name)
            owner = _submodule(root, owner_name)
            setattr(owner, attr, nn.Parameter(torch.empty(t.shape, dtype=t.dtype), requires_grad=False))
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(_submodule(root, parent), leaf, module)
    return root


def _submodule(root: nn.Module, dotted: str) -> nn.Module:
    m = root
    for part in filter(None, dotted.split(".")):
        if not hasattr(m, part):
            setattr(m, part, nn.Module())
        m = getattr(m, part)
    return m
