"""Map and structurally check a Gemma 4 MoE checkpoint's tensors before any conversion.

Shared by every target: each source tensor is assigned to exactly one rule of the
name table (``g4.exporters.nvfp4_names``; unmapped tensors are errors), and each decoder
layer must hold exactly the tensors a Gemma 4 MoE layer has: ``v_proj`` only on layers
that are not ``attention_k_eq_v`` full attention (case P08), fused experts of the shape
the config gives.
"""

from __future__ import annotations

from g4.exporters.nvfp4_names import (
    DENSE_GROUPS,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    LAYER_KEEP,
    SourceMap,
    map_sources,
)

from .checkpoint import Checkpoint
from .errors import CheckpointError, MappingError


def checked_sources(ckpt: Checkpoint) -> SourceMap:
    """:func:`map_sources` plus per-layer structure checks.

    Raises:
        MappingError: unmapped, missing or extra (``v_proj`` on a k_eq_v layer, a physical
            ``lm_head.weight`` in a tied model) tensors.
        CheckpointError: fused expert shapes that disagree with the config.
    """
    smap = map_sources(list(ckpt.tensors), prefix=ckpt.prefix, num_layers=ckpt.num_layers)
    tc = ckpt.text_config
    tied = tc.get("tie_word_embeddings", ckpt.config.get("tie_word_embeddings", True))
    if smap.lm_head and tied:
        raise MappingError(f"tensor {smap.lm_head}: present although tie_word_embeddings is true (case P06: loaders "
                           "disagree on such checkpoints); remove it, or set tie_word_embeddings to false")
    layer_types = tc.get("layer_types") or []
    k_eq_v = bool(tc.get("attention_k_eq_v", False))
    n_exp, inter, hidden = int(tc["num_experts"]), int(tc["moe_intermediate_size"]), int(tc["hidden_size"])
    for ls in smap.layers:
        L, src = ls.index, ls.tensors
        where = f"layer {L} ({ckpt.layer_prefix(L)}*)"
        no_v = k_eq_v and L < len(layer_types) and layer_types[L] == "full_attention"
        required = set(LAYER_KEEP) | {EXPERT_GATE_UP, EXPERT_DOWN}
        for g in DENSE_GROUPS:
            required |= {f"{m}.weight" for m in g.members if m not in g.optional}
        if not no_v:
            required.add("self_attn.v_proj.weight")
        elif "self_attn.v_proj.weight" in src:
            raise MappingError(f"tensor {src['self_attn.v_proj.weight']}: {where} is a k_eq_v full-attention "
                               "layer and must not have a v_proj (V is taken from k_proj)")
        missing = sorted(required - set(src))
        if missing:
            raise MappingError(f"{where}: missing tensor(s) {', '.join(missing)}")
        gu, dn = ckpt.tensors[src[EXPERT_GATE_UP]].shape, ckpt.tensors[src[EXPERT_DOWN]].shape
        if gu != (n_exp, 2 * inter, hidden) or dn != (n_exp, hidden, inter):
            raise CheckpointError(f"{where}: experts are gate_up {list(gu)} / down {list(dn)}, config says "
                                  f"[{n_exp}, {2 * inter}, {hidden}] / [{n_exp}, {hidden}, {inter}]")
    return smap
