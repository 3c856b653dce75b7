"""Every g4 name the NxD CPU lane uses, imported here only (g4's modules are being moved; repoint
these lines and nothing else). Rank-file keys come from g4's layout table
(``g4.exporters.neuron_int8``), never written out here."""

import re

from g4.convert.resolve import EMBEDDED_DIR  # noqa: F401
from g4.convert.int8_neuron import convert_int8_neuron  # noqa: F401
from g4.exporters.neuron_int8 import (  # noqa: F401
    COLUMN,
    EMBED_COLUMNS,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    KV_HEADS,
    RANK_INDEX,
    ROW,
    geometry,
    is_rank_index,
    layer_entries,
    layer_prefix,
    model_entries,
    parse_rank_name,
)


def rank_module(hf_module: str) -> str:
    """The rank-file module path of a Hugging Face text-model module path (no ``model.`` /
    ``language_model.`` prefix): ``layers.0.experts.gate_up_proj`` ->
    ``layers.0.moe.expert_mlps.mlp_op.gate_up_proj``; outside the layers unchanged."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", hf_module)
    if not m:
        return hf_module
    for e in layer_entries(has_v=True, quantize_attention=True):
        if e.source_module == m.group(2):
            return layer_prefix(int(m.group(1))) + e.key
    raise KeyError(hf_module)


def rank_tensor(hf_name: str) -> str:
    """The rank-file key of a Hugging Face text-model tensor name (``.weight`` kept)."""
    if hf_name.endswith(".weight"):
        return rank_module(hf_name[: -len(".weight")]) + ".weight"
    return rank_module(hf_name)


def rank_indices(names) -> list[str]:
    """The keys among ``names`` that are NxD SPMD rank indices (int32 ``[rank]``)."""
    return [n for n in names if (r := parse_rank_name(n)) is not None and is_rank_index(r.entry)]
