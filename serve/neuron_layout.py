"""The int8-neuron checkpoint layout: one declarative table shared by the exporter
(``g4.exporters.neuron_int8``) and the per-rank model (``g4.serve.neuron_emulator``),
so file keys and module names cannot drift apart.

Per TP rank ``r`` of ``T`` (file ``weights/tp{r}_sharded_checkpoint.safetensors``), keys
are relative to the text model (NxDI convention: no ``model.`` prefix). Rules follow
aws-neuron/neuronx-distributed ``trace/trace.py:create_local_weight`` and the quantized
parallel layers (``quantization/quantization_layers.py``):

- column-parallel (q/k/v, dense gate/up, lm_head): output rows split; int8 ``weight``
  ``[out/T, in]`` and fp32 ``scale`` ``[out/T, 1]`` split with them;
- row-parallel (o_proj, dense down): input columns split, ``weight`` ``[out, in/T]``,
  ``scale`` ``[out, 1]`` replicated on every rank;
- experts in NxD's fused layout (``ExpertFusedColumnParallelLinear`` /
  ``ExpertFusedRowParallelLinear``, expert-wise per-channel scales):
  ``experts.gate_up_proj.weight`` int8 ``[E, H, 2I/T]`` = ``[gate_r | up_r]`` (stride 2:
  rank r gets its slice of the gate columns and its slice of the up columns, never a slice
  of the fused dimension), ``.scale`` fp32 ``[E, 1, 2I/T]`` split the same way;
  ``experts.down_proj.weight`` int8 ``[E, I/T, H]``, ``.scale`` fp32 ``[E, 1, H]``
  replicated. (Hugging Face stores ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``;
  the NxD layout is their ``transpose(1, 2)``.)
- KV heads: a layer with fewer KV heads than ranks replicates whole KV heads so that each
  rank holds the KV head its query heads use; full-attention layers with
  ``attention_k_eq_v`` have no ``v_proj`` (V is taken from K).
- everything else (norms, router, ``layer_scalar``) is replicated in bf16.

The host keeps the unscaled bf16 embedding table (``embed_tokens.safetensors``); the
runtime multiplies looked-up rows by ``embed_scale = bf16(sqrt(hidden_size))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from g4.convert.errors import G4Error
from g4.convert.gemma4 import ATTENTION_NORMS, LAYER_NORMS, Architecture, embed_scale, read_architecture, tp_problems
from g4.exporters.safetensors_writer import TensorSpec

COLUMN, ROW, REPLICATED, EXPERT_GATE_UP, EXPERT_DOWN = "column", "row", "replicated", "expert_gate_up", "expert_down"
LAYOUT_NAME = "g4-int8-neuron/1"


@dataclass(frozen=True)
class Entry:
    """One module's tensors in a rank file.

    ``key``: module name relative to the layer (or the model); ``source``: the Hugging
    Face tensor it comes from (relative to the layer / language-model prefix); ``rule``:
    how it is split; ``int8``: written as int8 ``weight`` + fp32 ``scale`` (else one
    tensor in the source dtype under ``key`` + ``suffix``).
    """

    key: str
    source: str
    rule: str
    int8: bool
    suffix: str = ".weight"


def layer_entries(*, has_v: bool, quantize_attention: bool) -> list[Entry]:
    """Entries of one decoder layer, in file order."""
    attn = [Entry("self_attn.q_proj", "self_attn.q_proj.weight", COLUMN, quantize_attention),
            Entry("self_attn.k_proj", "self_attn.k_proj.weight", COLUMN, quantize_attention)]
    if has_v:
        attn.append(Entry("self_attn.v_proj", "self_attn.v_proj.weight", COLUMN, quantize_attention))
    attn.append(Entry("self_attn.o_proj", "self_attn.o_proj.weight", ROW, quantize_attention))
    norms = [Entry(n, f"{n}.weight", REPLICATED, False) for n in LAYER_NORMS + ATTENTION_NORMS]
    return norms + attn + [
        Entry("mlp.gate_proj", "mlp.gate_proj.weight", COLUMN, True),
        Entry("mlp.up_proj", "mlp.up_proj.weight", COLUMN, True),
        Entry("mlp.down_proj", "mlp.down_proj.weight", ROW, True),
        Entry("router.proj", "router.proj.weight", REPLICATED, False),
        Entry("router.scale", "router.scale", REPLICATED, False, suffix=""),
        Entry("router.per_expert_scale", "router.per_expert_scale", REPLICATED, False, suffix=""),
        Entry("experts.gate_up_proj", "experts.gate_up_proj", EXPERT_GATE_UP, True),
        Entry("experts.down_proj", "experts.down_proj", EXPERT_DOWN, True),
        Entry("layer_scalar", "layer_scalar", REPLICATED, False, suffix=""),
    ]


def model_entries(*, tied: bool) -> list[Entry]:
    """Entries outside the decoder layers, in file order: the final norm and the lm_head, built
    from ``embed_tokens.weight`` when the model is tied and from its own top-level
    ``lm_head.weight`` when it is not."""
    return [Entry("norm", "norm.weight", REPLICATED, False),
            Entry("lm_head", "embed_tokens.weight" if tied else "lm_head.weight", COLUMN, True)]


@dataclass(frozen=True)
class Geometry:
    """A Gemma 4 MoE :class:`~g4.convert.gemma4.Architecture` split over ``tp`` ranks: the
    architecture's sizes under the names the layout uses, per-layer lists, and where the KV
    heads go. ``kv_per_rank(L)``: heads each rank holds (1 when replicated);
    ``kv_head_of_rank(L, r)``: the first source KV head rank r holds.
    """

    arch: Architecture
    tp: int

    hidden = property(lambda self: self.arch.hidden)
    heads = property(lambda self: self.arch.heads)
    intermediate = property(lambda self: self.arch.intermediate)
    moe_intermediate = property(lambda self: self.arch.moe_intermediate)
    experts = property(lambda self: self.arch.experts)
    vocab = property(lambda self: self.arch.vocab)
    num_layers = property(lambda self: self.arch.num_layers)
    layer_types = property(lambda self: self.arch.layer_types)
    head_dim = property(lambda self: [a.head_dim for a in self.arch.layers])
    kv_heads = property(lambda self: [a.kv_heads for a in self.arch.layers])
    has_v = property(lambda self: [a.has_v for a in self.arch.layers])

    def kv_per_rank(self, layer: int) -> int:
        return self.arch.kv_per_rank(layer, self.tp)

    def kv_head_of_rank(self, layer: int, rank: int) -> int:
        """First source KV head on ``rank``: the one its first query head attends with."""
        return self.arch.kv_head_of_rank(layer, rank, self.tp)


def geometry(config: dict, tp: int) -> Geometry:
    """``config`` (multimodal, text, release or ``per_layer_config`` form) at TP ``tp``.

    Parsing and the TP rules are the memory planner's (:func:`g4.convert.gemma4.read_architecture`,
    :func:`g4.convert.gemma4.tp_problems`), so the plan and the files cannot disagree.

    Raises:
        G4Error: not a Gemma 4 MoE config, or a TP degree the model cannot be split over.
    """
    arch = read_architecture(config)
    problems = tp_problems(arch, tp)
    if problems:
        raise G4Error(f"tensor parallel degree {tp} cannot be used: " + "; ".join(problems))
    return Geometry(arch, tp)


def _shape_for_rank(e: Entry, shape: tuple[int, ...], g: Geometry, layer: int | None) -> tuple[int, ...]:
    T = g.tp
    if e.rule == COLUMN:
        out = shape[0] // T
        if layer is not None and e.key in ("self_attn.k_proj", "self_attn.v_proj"):
            out = g.kv_per_rank(layer) * g.head_dim[layer]
        return (out, *shape[1:])
    if e.rule == ROW:
        return (shape[0], shape[1] // T)
    if e.rule == EXPERT_GATE_UP:  # HF [E, 2I, H] -> NxD [E, H, 2I/T]
        return (shape[0], shape[2], shape[1] // T)
    if e.rule == EXPERT_DOWN:  # HF [E, H, I] -> NxD [E, I/T, H]
        return (shape[0], shape[2] // T, shape[1])
    return tuple(shape)


def _scale_shape(e: Entry, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    if e.rule == EXPERT_GATE_UP:
        return (weight_shape[0], 1, weight_shape[2])
    if e.rule == EXPERT_DOWN:
        return (weight_shape[0], 1, weight_shape[2])
    return (weight_shape[0], 1)


def entry_specs(e: Entry, prefix: str, source_shape: tuple[int, ...], source_dtype: torch.dtype,
                g: Geometry, layer: int | None) -> list[TensorSpec]:
    """The rank-file tensors of one entry (same names and shapes on every rank)."""
    shape = _shape_for_rank(e, source_shape, g, layer)
    if not e.int8:
        return [TensorSpec(f"{prefix}{e.key}{e.suffix}", source_dtype, shape)]
    return [TensorSpec(f"{prefix}{e.key}.weight", torch.int8, shape),
            TensorSpec(f"{prefix}{e.key}.scale", torch.float32, _scale_shape(e, shape))]


def check_embed_scale(manifest: dict, g: Geometry, where) -> float:
    """The manifest's ``embed_scale``, checked against ``bf16(sqrt(hidden_size))`` from the
    config (what ``Gemma4TextScaledWordEmbedding`` multiplies by; case P12: a dropped or
    double scale gives wrong output that a small end-to-end check may not notice).

    Raises:
        CheckpointError: missing or different value (naming ``where``).
    """
    from g4.convert.errors import CheckpointError

    expected = embed_scale(g.hidden)
    got = manifest.get("embed_scale")
    if not isinstance(got, (int, float)) or float(got) != expected:
        raise CheckpointError(f"{where}: embed_scale {got!r}, but hidden_size {g.hidden} needs "
                              f"bf16(sqrt({g.hidden})) = {expected:g} (P12)")
    return expected
