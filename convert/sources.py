"""Map and structurally check a Gemma 4 MoE checkpoint's tensors before any conversion.

Shared by every target: each source tensor is assigned to exactly one rule of the
name table (``g4.exporters.nvfp4_names``; unmapped tensors are errors), and each decoder
layer must hold exactly the tensors a Gemma 4 MoE layer has: ``v_proj`` only on layers
that are not ``attention_k_eq_v`` full attention (case P08), fused experts of the shape
the config gives, and q/k projections of the head dim and KV heads the config gives the
layer in either config form (case P17).
"""

from __future__ import annotations

from g4.core.checkpoint import Checkpoint
from g4.core.errors import CheckpointError, G4Error, MappingError
from g4.core.gemma4 import EXPERT_DOWN, EXPERT_GATE_UP, LM_HEAD, release_config
from g4.exporters.nvfp4_names import SourceMap, map_sources


def checked_sources(ckpt: Checkpoint) -> SourceMap:
    """:func:`map_sources` plus per-layer structure checks.

    Raises:
        MappingError: unmapped, missing or extra (``v_proj`` on a k_eq_v layer, a physical
            ``lm_head.weight`` in a tied model, none in an untied one) tensors.
        CheckpointError: tensor shapes that disagree with the config (embedding and lm_head
            against ``vocab_size``, fused experts, q/k projections, every layer tensor).
    """
    smap = map_sources(list(ckpt.tensors), prefix=ckpt.prefix, num_layers=ckpt.num_layers)
    if smap.lm_head and ckpt.arch.tied:
        raise MappingError(f"tensor {smap.lm_head}: present although tie_word_embeddings is true (case P06: loaders "
                           "disagree on such checkpoints); remove it, or set tie_word_embeddings to false")
    if not smap.lm_head and not ckpt.arch.tied:
        raise MappingError("tensor lm_head.weight: missing although tie_word_embeddings is false (the model has its "
                           "own lm_head; without it every target would get a wrong or random head)")
    try:
        release_config(ckpt.config)  # refuse now a per_layer_config that OUT's release-form config cannot carry
    except G4Error as e:
        raise CheckpointError(f"{ckpt.root / 'config.json'}: {e}") from e
    arch = ckpt.arch
    for rel, want in arch.model_tensor_shapes().items():  # embedding, final norm, an untied lm_head
        name = smap.lm_head if rel == LM_HEAD else f"{ckpt.prefix}{rel}"
        info = ckpt.tensors.get(name)
        if info is None:
            raise MappingError(f"tensor {name}: missing")
        if info.shape != want:
            raise CheckpointError(f"tensor {name}: {list(info.shape)}, config says {list(want)} "
                                  f"(vocab_size {arch.vocab}, hidden_size {arch.hidden})")
    for ls in smap.layers:
        L, src = ls.index, ls.tensors
        where = f"layer {L} ({ckpt.layer_prefix(L)}*)"
        expected = arch.layer_tensor_shapes(L)  # the architecture's inventory: v_proj only where the layer has one
        if "self_attn.v_proj.weight" not in expected and "self_attn.v_proj.weight" in src:
            raise MappingError(f"tensor {src['self_attn.v_proj.weight']}: {where} is a k_eq_v full-attention "
                               "layer and must not have a v_proj (V is taken from k_proj)")
        missing = sorted(set(expected) - set(src))
        if missing:
            raise MappingError(f"{where}: missing tensor(s) {', '.join(missing)}")
        att, heads, hidden = arch.layers[L], arch.heads, arch.hidden
        for proj in ("q_proj", "k_proj"):
            name = src[f"self_attn.{proj}.weight"]
            shape, want = ckpt.tensors[name].shape, expected[f"self_attn.{proj}.weight"]
            if shape != want:
                raise CheckpointError(f"tensor {name}: {list(shape)}, config says {list(want)} "
                                      f"({'full' if not att.sliding else 'sliding'} attention: "
                                      f"head_dim {att.head_dim}, {att.kv_heads} KV heads, {heads} heads) (P17)")
        gu, dn = ckpt.tensors[src[EXPERT_GATE_UP]].shape, ckpt.tensors[src[EXPERT_DOWN]].shape
        if gu != expected[EXPERT_GATE_UP] or dn != expected[EXPERT_DOWN]:
            raise CheckpointError(f"{where}: experts are gate_up {list(gu)} / down {list(dn)}, config says "
                                  f"{list(expected[EXPERT_GATE_UP])} / {list(expected[EXPERT_DOWN])}")
        for suffix, want in expected.items():
            shape = ckpt.tensors[src[suffix]].shape
            if shape != want:
                raise CheckpointError(f"tensor {src[suffix]}: {list(shape)}, config says {list(want)}")
    return smap
