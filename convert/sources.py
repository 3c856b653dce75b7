"""Map and structurally check a Gemma 4 MoE checkpoint's tensors before any conversion.

Shared by every target: each source tensor is assigned to exactly one rule of the
name table (``g4.exporters.nvfp4_names``; unmapped tensors are errors), and each decoder
layer must hold exactly the tensors a Gemma 4 MoE layer has: ``v_proj`` only on layers
that are not ``attention_k_eq_v`` full attention (case P08), fused experts of the shape
the config gives, and q/k projections of the head dim and KV heads the config gives the
layer in either config form (case P17).
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
from .errors import CheckpointError, G4Error, MappingError
from .gemma4 import release_config


def checked_sources(ckpt: Checkpoint) -> SourceMap:
    """:func:`map_sources` plus per-layer structure checks.

    Raises:
        MappingError: unmapped, missing or extra (``v_proj`` on a k_eq_v layer, a physical
            ``lm_head.weight`` in a tied model, none in an untied one) tensors.
        CheckpointError: fused expert shapes that disagree with the config.
    """
    smap = map_sources(list(ckpt.tensors), prefix=ckpt.prefix, num_layers=ckpt.num_layers)
    tc = ckpt.text_config
    if smap.lm_head and ckpt.arch.tied:
        raise MappingError(f"tensor {smap.lm_head}: present although tie_word_embeddings is true (case P06: loaders "
                           "disagree on such checkpoints); remove it, or set tie_word_embeddings to false")
    if not smap.lm_head and not ckpt.arch.tied:
        raise MappingError("tensor lm_head.weight: missing although tie_word_embeddings is false (the model has its "
                           "own lm_head; without it every target would get a wrong or random head)")
    attention = ckpt.arch.layers
    try:
        release_config(ckpt.config)  # refuse now a per_layer_config that OUT's release-form config cannot carry
    except G4Error as e:
        raise CheckpointError(f"{ckpt.root / 'config.json'}: {e}") from e
    n_exp, inter, hidden = int(tc["num_experts"]), int(tc["moe_intermediate_size"]), int(tc["hidden_size"])
    for ls in smap.layers:
        L, src = ls.index, ls.tensors
        where = f"layer {L} ({ckpt.layer_prefix(L)}*)"
        no_v = not attention[L].has_v
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
        att, heads = attention[L], int(tc["num_attention_heads"])
        for proj, rows in (("q_proj", heads * att.head_dim), ("k_proj", att.kv_heads * att.head_dim)):
            shape = ckpt.tensors[src[f"self_attn.{proj}.weight"]].shape
            if shape != (rows, hidden):
                raise CheckpointError(f"tensor {src[f'self_attn.{proj}.weight']}: {list(shape)}, config says "
                                      f"[{rows}, {hidden}] ({'full' if not att.sliding else 'sliding'} attention: "
                                      f"head_dim {att.head_dim}, {att.kv_heads} KV heads, {heads} heads) (P17)")
        gu, dn = ckpt.tensors[src[EXPERT_GATE_UP]].shape, ckpt.tensors[src[EXPERT_DOWN]].shape
        if gu != (n_exp, 2 * inter, hidden) or dn != (n_exp, hidden, inter):
            raise CheckpointError(f"{where}: experts are gate_up {list(gu)} / down {list(dn)}, config says "
                                  f"[{n_exp}, {2 * inter}, {hidden}] / [{n_exp}, {hidden}, {inter}]")
    return smap
