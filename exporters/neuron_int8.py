"""The int8-neuron output contract, beside its writer (``g4.convert.int8_neuron``): the file
names, the layout table, the sharding rules and the typed ``manifest.json``. The exporter,
the CPU emulator (``g4.serve.neuron_emulator``), the rank-file check (:func:`check_rank_files`,
used by ``g4.exporters.formats.check_result`` and ``g4.serve.neuron_runtime``) and the neuron serving engine (``g4.serve.neuron_backend``) read it
from here, so file keys, per-rank shapes and manifest fields cannot drift apart.

Per TP rank ``r`` of ``T`` (file ``weights/tp{r}_sharded_checkpoint.safetensors``), the keys,
dtypes and per-rank shapes are exactly the ``state_dict()`` of g4's NxD Inference class at TP ``T``
(``g4.serve.nxdi_gemma4.NeuronGemma4MoEModel``, built with ``torch_dtype=bfloat16``): the names of
its module tree, relative to the text model (no ``model.`` prefix). So NxDI's Route 2 (pre-sharded
per-rank files, aws-neuron/neuronx-distributed-inference
``src/neuronx_distributed_inference/models/application_base.py``: ``load_weights`` reads
``weights/tp{rank}_sharded_checkpoint.safetensors`` and calls ``nxd_model.initialize`` with no
key conversion) can read them as they are. Besides the weights each rank file holds the rank
indices NxD's SPMD modules keep as parameters (``rank_util.rank`` of ``NeuronBaseModel`` and
``moe.expert_mlps.spmd_rank.rank`` of ``ExpertMLPsV2``: int32 ``[1]`` = ``[r]``, what NxD's sharder
cuts from ``arange(T)``) and the class's device embedding shard (NxD ``ParallelEmbedding`` with
``shard_across_embedding``: ``embed_tokens.weight`` ``[V, H/T]``, unscaled). Rules follow
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

Module names (rank file -> Hugging Face source): the router is ``moe.router.*`` (``router.*``),
the experts ``moe.expert_mlps.mlp_op.{gate_up_proj,down_proj}`` (``experts.*``, NxD's
``ExpertMLPsV2.mlp_op``); attention, dense MLP, norms and ``layer_scalar`` keep the source names.
:func:`layer_entries` / :func:`model_entries` are the only place these names are written.

The host keeps the unscaled bf16 embedding table (``embed_tokens.safetensors``); the
runtime multiplies looked-up rows by ``embed_scale = bf16(sqrt(hidden_size))``
(:func:`g4.core.gemma4.embed_scale`), which :meth:`Manifest.check_embed_scale` checks.

Each sharding rule is an object with the rank-local shape of a source tensor and the
rank's ``take`` of it (weight and int8 scale together); KV projections have their own rule
(:data:`KV_HEADS`), not a test on the key name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

import torch

from g4.core.checkpoint import CONFIG_NAME, read_json_object, read_safetensors_header
from g4.core.errors import CheckpointError, G4Error
from g4.core.gemma4 import (
    ATTENTION_NORMS,
    EXPERT_DOWN as EXPERT_DOWN_SOURCE,
    EXPERT_GATE_UP as EXPERT_GATE_UP_SOURCE,
    LAYER_MODULE_KINDS,
    LAYER_NORMS,
    LM_HEAD,
    MODEL_MODULE_KINDS,
    Architecture,
    embed_scale,
    read_architecture,
    tp_refusal,
)
from g4.exporters.safetensors_writer import TensorSpec
from g4.quantizers.int8 import Int8Weight

LAYOUT_NAME = "g4-int8-neuron/2"  # /2: keys are the NxDI class's state_dict() names; /1 had g4's own
WEIGHTS_DIR = "weights"
EMBED_FILE = "embed_tokens.safetensors"
EMBED_TENSOR = "embed_tokens.weight"
# dtype of every tensor the layout keeps unquantized and of the host embedding table, whatever the
# source's (BF16, F16 or F32): g4serve compiles g4's NxDI class with torch_dtype=bfloat16, the
# runtime's rank-file check and embed_scale = bf16(sqrt(hidden_size)) assume it.
KEPT_DTYPE = torch.bfloat16
MANIFEST = "manifest.json"
# g4serve's Neuron compile of a result (serve/neuron_backend.py): its default folder inside OUT and the
# stamp file that marks a folder as g4's compile. Machine-specific and not part of the result: never
# pushed (convert/card.py repo_files); NxDI writes this machine's paths into it (neuron_config.json).
COMPILED_DIR = "neuron_compiled"
COMPILED_STAMP = "g4_compiled.json"
# Tokens (prompt plus reply) an int8-neuron result is served with when neither the conversion
# (``g4convert int8-neuron --seq-len``) nor an older manifest says otherwise: the length the
# memory plan sizes the KV cache for; capped at the model's ``max_position_embeddings``.
DEFAULT_MAX_LENGTH = 8192
# Longest prompt (tokens) an int8-neuron result encodes in one context-encoding call when the
# conversion (``g4convert int8-neuron --max-context-length``) does not say: NxDI's
# ``max_context_length``, the largest context-encoding bucket; token generation still runs to
# ``max_length``. g4's NxDI class computes context-encoding attention as plain fp32 scores
# ``[heads / T, S, S]`` for a bucket of S (``g4.serve.nxdi_gemma4.NeuronGemma4Attention``), which
# the memory plan counts and which grows with S squared; NxDI's own attention leaves that form for
# its flash-attention kernel from 4096 tokens (aws-neuron/neuronx-distributed-inference
# ``src/neuronx_distributed_inference/modules/attention/attention_base.py``:
# ``get_flash_attention_strategy``, LNC 1 as on inf2), a kernel g4's class does not use.
DEFAULT_MAX_CONTEXT_LENGTH = 4096
# The smallest bucket of NxDI's default bucketing (aws-neuron/neuronx-distributed-inference
# ``src/neuronx_distributed_inference/modules/autobucketing.py``: ``generate_buckets(128, max)``).
MIN_BUCKET = 128


def layer_prefix(layer: int) -> str:
    """Key prefix of decoder layer ``layer`` in a rank file (NxDI: relative to the text model)."""
    return f"layers.{layer}."


def rank_file(rank: int) -> str:
    """``weights/tp{rank}_sharded_checkpoint.safetensors`` (NxDI / optimum-neuron convention)."""
    return f"{WEIGHTS_DIR}/tp{rank}_sharded_checkpoint.safetensors"


def neuron_buckets(max_length: int) -> list[int]:
    """NxDI's default bucket ladder for sequences of at most ``max_length`` tokens: powers of two
    from :data:`MIN_BUCKET` below ``round(log2(max_length))``, then ``max_length`` itself (just
    ``[max_length]`` when it is at most :data:`MIN_BUCKET`), as aws-neuron/neuronx-distributed-inference
    ``src/neuronx_distributed_inference/modules/autobucketing.py: generate_buckets`` computes it.
    E.g. 8192 -> ``[128, 256, 512, 1024, 2048, 4096, 8192]``, 3000 -> ``[128, ..., 2048, 3000]``."""
    if max_length <= MIN_BUCKET:
        return [max_length]
    low, high = MIN_BUCKET.bit_length() - 1, round(math.log2(max_length))
    return [2 ** i for i in range(low, high) if 2 ** i < max_length] + [max_length]


def serving_max_length(seq_len: int | None, max_positions: int | None) -> int:
    """Tokens an int8-neuron result is compiled and served for: ``seq_len`` (asked for at
    conversion), else :data:`DEFAULT_MAX_LENGTH` capped at ``max_positions``
    (``max_position_embeddings``).

    Raises:
        G4Error: ``seq_len`` below 1 or above ``max_positions``.
    """
    if seq_len is None:
        return min(DEFAULT_MAX_LENGTH, max_positions or DEFAULT_MAX_LENGTH)
    if seq_len < 1 or (max_positions and seq_len > max_positions):
        raise G4Error(f"--seq-len {seq_len}: the model takes 1 to {max_positions} tokens (max_position_embeddings)")
    return seq_len


def serving_max_context_length(max_context_length: int | None, max_length: int) -> int:
    """Longest prompt (tokens) an int8-neuron result is compiled to encode: NxDI's
    ``max_context_length``, the largest context-encoding bucket. ``max_context_length`` (asked
    for at conversion), else :data:`DEFAULT_MAX_CONTEXT_LENGTH`, capped at ``max_length`` (the
    KV cache length, prompt plus reply; NxDI's ``models/config.py`` asserts
    ``max_context_length <= max_length``).

    Raises:
        G4Error: ``max_context_length`` below 1 or above ``max_length``.
    """
    if max_context_length is None:
        return min(DEFAULT_MAX_CONTEXT_LENGTH, max_length)
    if not 1 <= max_context_length <= max_length:
        raise G4Error(f"--max-context-length {max_context_length}: a prompt can be 1 to {max_length} tokens "
                      "(--seq-len, prompt plus reply)")
    return max_context_length


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class Geometry:
    """A Gemma 4 MoE :class:`~g4.core.gemma4.Architecture` split over ``tp`` ranks: the
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

    Parsing and the TP rules are the memory planner's (:func:`g4.core.gemma4.read_architecture`,
    :func:`g4.core.gemma4.tp_refusal`), so the plan and the files cannot disagree.

    Raises:
        G4Error: not a Gemma 4 MoE config, or a TP degree the model cannot be split over.
    """
    arch = read_architecture(config)
    why = tp_refusal(arch, tp)
    if why:
        raise G4Error(f"tensor parallel degree {tp} cannot be used: {why}")
    return Geometry(arch, tp)


# --------------------------------------------------------------------------- sharding rules


class Rule:
    """How one source tensor (Hugging Face layout) is split over the ranks.

    :meth:`local_shape`: the rank-local shape (the same on every rank); :meth:`scale_shape`:
    the fp32 per-channel scale of a local int8 weight; :meth:`take`: rank ``rank``'s weight
    and scale (``scale`` is None for a tensor kept in its dtype).
    """

    name = ""

    def local_shape(self, shape: tuple[int, ...], g: Geometry, layer: int | None) -> tuple[int, ...]:
        return tuple(shape)

    def dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        """dtype of a tensor kept unquantized (the source's)."""
        return source_dtype

    def scale_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (local[0], 1)

    def take(self, w: torch.Tensor, s: torch.Tensor | None, g: Geometry, layer: int | None, rank: int):
        return w, s

    # ``rank_split(x, tp)``: ``x`` (the whole tensor or its int8 codes, Hugging Face layout) as one
    # view whose ``[r]`` holds rank r's share, and ``rank_major(x, tp)``: that view contiguous,
    # ``[T, *local]``, for the rules whose shares are a permutation of whole dimensions (the
    # experts): every rank's codes then come out of one quantizing pass (:class:`RankMajor`).
    # None elsewhere (:meth:`take` cuts each rank's share).
    rank_split = None
    rank_major = None

    def gather(self, parts: list[torch.Tensor], g: Geometry, layer: int | None) -> torch.Tensor:
        """The inverse of :meth:`take`: every rank's local tensor (``parts[r]``, rank order, already
        dequantized when int8) back to the whole source tensor in the Hugging Face layout
        (a replicated tensor: rank 0's)."""
        return parts[0]

    def __repr__(self) -> str:
        return self.name


class _Replicated(Rule):
    """Norms, router, ``layer_scalar``: the whole tensor on every rank."""

    name = "replicated"


class _Column(Rule):
    """Column-parallel (q, dense gate/up, lm_head): output rows and their scales split."""

    name = "column"

    def local_shape(self, shape, g, layer):
        return (shape[0] // g.tp, *shape[1:])

    def take(self, w, s, g, layer, rank):
        per = w.shape[0] // g.tp
        rows = slice(rank * per, (rank + 1) * per)
        return w[rows], None if s is None else s[rows]

    def gather(self, parts, g, layer):
        return torch.cat(parts, dim=0)


class _KvHeads(Rule):
    """k/v projections: whole KV heads per rank, replicated when there are fewer KV heads
    than ranks (each rank holds the KV head its query heads use)."""

    name = "column"  # a column-parallel layer to NxD; its rows are whole heads

    def local_shape(self, shape, g, layer):
        return (g.kv_per_rank(layer) * g.head_dim[layer], *shape[1:])

    def take(self, w, s, g, layer, rank):
        hd, first = g.head_dim[layer], g.kv_head_of_rank(layer, rank)
        rows = slice(first * hd, (first + g.kv_per_rank(layer)) * hd)
        return w[rows], None if s is None else s[rows]

    def gather(self, parts, g, layer):  # a replicated KV head comes back from its first rank
        hd, per = g.head_dim[layer], g.kv_per_rank(layer)
        out = parts[0].new_empty((g.kv_heads[layer] * hd, *parts[0].shape[1:]))
        for rank in reversed(range(g.tp)):
            first = g.kv_head_of_rank(layer, rank)
            out[first * hd : (first + per) * hd] = parts[rank]
        return out


class _Row(Rule):
    """Row-parallel (o_proj, dense down): input columns split, output-channel scales replicated."""

    name = "row"

    def local_shape(self, shape, g, layer):
        return (shape[0], shape[1] // g.tp)

    def take(self, w, s, g, layer, rank):
        per = w.shape[1] // g.tp
        return w[:, rank * per : (rank + 1) * per], s

    def gather(self, parts, g, layer):
        return torch.cat(parts, dim=1)


class _EmbedColumns(_Row):
    """The device embedding of NxD's ``ParallelEmbedding(shard_across_embedding=True)``
    (aws-neuron/neuronx-distributed ``src/neuronx_distributed/parallel_layers/layers.py``):
    ``[V, H]`` -> ``[V, H/T]``, rank r the columns ``[r*H/T, (r+1)*H/T)``: the row-parallel cut
    of the last dim, under its own name in the manifest."""

    name = "embedding_columns"


class _RankIndex(Rule):
    """An NxD SPMD rank index (``SPMDRank.rank``, aws-neuron/neuronx-distributed
    ``src/neuronx_distributed/parallel_layers/layers.py``): a parameter ``arange(T)`` split over
    the ranks, so rank r holds int32 ``[r]``. It has no source tensor."""

    name = "rank_index"

    def local_shape(self, shape, g, layer):
        return (1,)

    def dtype(self, source_dtype):
        return torch.int32

    def take(self, w, s, g, layer, rank):
        return torch.tensor([rank], dtype=torch.int32), s

    def gather(self, parts, g, layer):
        raise ValueError("an NxD rank index has no source tensor to gather")


class _ExpertGateUp(Rule):
    """HF ``[E, 2I, H]`` -> NxD ``[E, H, 2I/T]`` = ``[gate_r | up_r]`` (stride 2; never a slice of
    the fused dimension, case P11); scale ``[E, 1, 2I/T]`` split the same way."""

    name = "expert_gate_up"

    def local_shape(self, shape, g, layer):
        return (shape[0], shape[2], shape[1] // g.tp)

    def scale_shape(self, local):
        return (local[0], 1, local[2])

    def rank_split(self, x, tp):
        """``[E, 2I, X]`` (weight ``X = H``, scale ``X = 1``) -> ``[T, E, X, 2, I/T]``: rank r's
        gate rows ``[r*I/T, (r+1)*I/T)`` then the same rows of up, transposed; ``[r]`` flattened
        over its last two dims is rank r's ``[E, X, 2I/T]``."""
        n_exp, two_i, x_dim = x.shape
        return x.view(n_exp, 2, tp, two_i // 2 // tp, x_dim).permute(2, 0, 4, 1, 3)

    def rank_major(self, x, tp):
        """Every rank's ``[E, X, 2I/T]`` at once, contiguous: ``[T, E, X, 2I/T]``."""
        return self.rank_split(x, tp).contiguous().flatten(-2)

    def take(self, w, s, g, layer, rank):  # rank r's share of rank_split (a copy of it alone)
        return w if w is None else self.rank_split(w, g.tp)[rank].flatten(-2), \
            None if s is None else self.rank_split(s, g.tp)[rank].flatten(-2)

    def gather(self, parts, g, layer):  # [E, H, 2I/T] = [gate_r | up_r] per rank -> [E, 2I, H] (gate rows first)
        halves = [p.transpose(1, 2).chunk(2, dim=1) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)


class _ExpertDown(Rule):
    """HF ``[E, H, I]`` -> NxD ``[E, I/T, H]``; scale ``[E, 1, H]`` replicated."""

    name = "expert_down"

    def local_shape(self, shape, g, layer):
        return (shape[0], shape[2] // g.tp, shape[1])

    def scale_shape(self, local):
        return (local[0], 1, local[2])

    def rank_split(self, x, tp):
        """Weight ``[E, H, I]`` -> ``[T, E, I/T, H]``: rank r the input columns
        ``[r*I/T, (r+1)*I/T)``, transposed (the scale ``[E, H, 1]`` is not split: replicated)."""
        n_exp, hidden, inter = x.shape
        return x.view(n_exp, hidden, tp, inter // tp).permute(2, 0, 3, 1)

    def rank_major(self, x, tp):
        """Every rank's ``[E, I/T, H]`` at once, contiguous: ``[T, E, I/T, H]``."""
        return self.rank_split(x, tp).contiguous()

    def take(self, w, s, g, layer, rank):  # a view of w: the writer copies it a few rows at a time
        return w if w is None else self.rank_split(w, g.tp)[rank], None if s is None else s.transpose(1, 2)

    def gather(self, parts, g, layer):  # [E, I/T, H] per rank -> [E, H, I]
        return torch.cat([p.transpose(1, 2) for p in parts], dim=2)


REPLICATED, COLUMN, KV_HEADS, ROW = _Replicated(), _Column(), _KvHeads(), _Row()
EXPERT_GATE_UP, EXPERT_DOWN = _ExpertGateUp(), _ExpertDown()
EMBED_COLUMNS, RANK_INDEX = _EmbedColumns(), _RankIndex()


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Entry:
    """One module's tensors in a rank file.

    ``key``: module name relative to the layer (or the model) in the NxDI class's module tree;
    ``source``: the Hugging Face tensor it comes from (relative to the layer / language-model
    prefix; ``lm_head.weight`` is top level; None for a rank index, which has no source);
    ``rule``: how it is split; ``int8``: written as int8 ``weight`` + fp32 ``scale`` (else one
    tensor in the source dtype under ``key`` + ``suffix``).
    """

    key: str
    source: str | None
    rule: Rule
    int8: bool
    suffix: str = ".weight"

    @property
    def source_module(self) -> str | None:
        """The Hugging Face (transformers) module path of the source, relative to the layer or
        the language model: ``source`` without ``.weight`` (``router.proj``,
        ``experts.gate_up_proj``, ``router.scale``); None for a rank index."""
        if self.source is None:
            return None
        return self.source[: -len(".weight")] if self.source.endswith(".weight") else self.source

    def names(self, prefix: str) -> list[str]:
        """Output tensor names of this entry under ``prefix`` (``layers.{L}.`` or ``""``)."""
        if self.int8:
            return [f"{prefix}{self.key}.weight", f"{prefix}{self.key}.scale"]
        return [f"{prefix}{self.key}{self.suffix}"]


def layer_entries(*, has_v: bool, quantize_attention: bool) -> list[Entry]:
    """Entries of one decoder layer, in file order."""
    attn = [Entry("self_attn.q_proj", "self_attn.q_proj.weight", COLUMN, quantize_attention),
            Entry("self_attn.k_proj", "self_attn.k_proj.weight", KV_HEADS, quantize_attention)]
    if has_v:
        attn.append(Entry("self_attn.v_proj", "self_attn.v_proj.weight", KV_HEADS, quantize_attention))
    attn.append(Entry("self_attn.o_proj", "self_attn.o_proj.weight", ROW, quantize_attention))
    norms = [Entry(n, f"{n}.weight", REPLICATED, False) for n in LAYER_NORMS + ATTENTION_NORMS]
    return norms + attn + [
        Entry("mlp.gate_proj", "mlp.gate_proj.weight", COLUMN, True),
        Entry("mlp.up_proj", "mlp.up_proj.weight", COLUMN, True),
        Entry("mlp.down_proj", "mlp.down_proj.weight", ROW, True),
        Entry("moe.router.proj", "router.proj.weight", REPLICATED, False),
        Entry("moe.router.scale", "router.scale", REPLICATED, False, suffix=""),
        Entry("moe.router.per_expert_scale", "router.per_expert_scale", REPLICATED, False, suffix=""),
        Entry("moe.expert_mlps.mlp_op.gate_up_proj", EXPERT_GATE_UP_SOURCE, EXPERT_GATE_UP, True),
        Entry("moe.expert_mlps.mlp_op.down_proj", EXPERT_DOWN_SOURCE, EXPERT_DOWN, True),
        Entry("moe.expert_mlps.spmd_rank.rank", None, RANK_INDEX, False, suffix=""),
        Entry("layer_scalar", "layer_scalar", REPLICATED, False, suffix=""),
    ]


# How the lm_head can be held on a Neuron rank: (rule, int8). ``g4convert int8-neuron`` writes
# ``int8-sharded``; the memory plan also weighs the bf16 alternatives.
LM_HEAD_LAYOUTS: dict[str, tuple[Rule, bool]] = {
    "int8-sharded": (COLUMN, True), "bf16-sharded": (COLUMN, False), "bf16-replicated": (REPLICATED, False)}
# The embedding table g4's NxDI class holds on the device: bf16, unscaled, hidden columns split
# (NxD ``ParallelEmbedding(shard_across_embedding=True)``). In every rank file.
DEVICE_EMBEDDING = Entry("embed_tokens", EMBED_TENSOR, EMBED_COLUMNS, False)


def model_entries(*, tied: bool, lm_head: str = "int8-sharded") -> list[Entry]:
    """Entries outside the decoder layers, in file order: the model's rank index, the device
    embedding shard (:data:`DEVICE_EMBEDDING`), the final norm and the lm_head, built from
    ``embed_tokens.weight`` when the model is tied and from its own top-level ``lm_head.weight``
    when it is not; ``lm_head`` is a key of :data:`LM_HEAD_LAYOUTS` (the exporter writes the
    default).

    Raises:
        KeyError: an ``lm_head`` layout not in :data:`LM_HEAD_LAYOUTS`.
    """
    rule, q = LM_HEAD_LAYOUTS[lm_head]
    return [Entry("rank_util.rank", None, RANK_INDEX, False, suffix=""),
            DEVICE_EMBEDDING,
            Entry("norm", "norm.weight", REPLICATED, False),
            Entry("lm_head", EMBED_TENSOR if tied else LM_HEAD, rule, q)]


def entry_of(source: str, *, has_v: bool = True, quantize_attention: bool = False) -> Entry:
    """The decoder-layer entry whose source is ``source`` (a Hugging Face tensor name relative to
    the layer, e.g. ``experts.gate_up_proj``).

    Raises:
        KeyError: no entry reads ``source``.
    """
    for e in layer_entries(has_v=has_v, quantize_attention=quantize_attention):
        if e.source == source:
            return e
    raise KeyError(source)


def is_rank_index(e: Entry) -> bool:
    """A per-rank index of NxD's SPMD modules (no source tensor, int32 ``[rank]``)."""
    return e.rule is RANK_INDEX


@dataclass(frozen=True)
class RankName:
    """One rank-file tensor name read back through the table: its entry, layer (None outside
    the layers), key prefix and model part (:data:`g4.core.gemma4.LAYER_MODULE_KINDS` of its
    source module, or :data:`RANK_INDEX_KIND`)."""

    entry: Entry
    layer: int | None
    prefix: str
    kind: str


_LAYER_NAME_RE = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER_NAMES = {n: e for q in (False, True) for e in layer_entries(has_v=True, quantize_attention=q)
                for n in e.names("")}
_MODEL_NAMES = {n: e for tied in (True, False) for e in model_entries(tied=tied) for n in e.names("")}


def parse_rank_name(name: str) -> RankName | None:
    """The table's reading of a rank-file tensor name (exact), or None for a name it never writes."""
    if name in _MODEL_NAMES:
        e = _MODEL_NAMES[name]
        return RankName(e, None, "", _kind(e, MODEL_MODULE_KINDS))
    m = _LAYER_NAME_RE.fullmatch(name)
    e = _LAYER_NAMES.get(m.group(2)) if m else None
    if e is None:
        return None
    return RankName(e, int(m.group(1)), layer_prefix(int(m.group(1))), _kind(e, LAYER_MODULE_KINDS))


RANK_INDEX_KIND = "NxD rank indices"


def _kind(e: Entry, kinds: dict[str, str]) -> str:
    return RANK_INDEX_KIND if e.source is None else kinds[e.source_module]


def entry_specs(e: Entry, prefix: str, source_shape: tuple[int, ...], source_dtype: torch.dtype,
                g: Geometry, layer: int | None) -> list[TensorSpec]:
    """The rank-file tensors of one entry (same names and shapes on every rank); a rank index
    (no source) ignores ``source_shape`` and ``source_dtype``."""
    shape = e.rule.local_shape(tuple(source_shape), g, layer)
    if not e.int8:
        return [TensorSpec(e.names(prefix)[0], e.rule.dtype(source_dtype), shape)]
    weight, scale = e.names(prefix)
    return [TensorSpec(weight, torch.int8, shape), TensorSpec(scale, torch.float32, e.rule.scale_shape(shape))]


def expected_rank_specs(config: dict, tp: int, *, quantize_attention: bool, dtype: torch.dtype = torch.bfloat16,
                        lm_head: str = "int8-sharded") -> list[TensorSpec]:
    """Every tensor of one rank file (name, dtype, per-rank shape), from the config alone: the
    ``state_dict()`` of g4's NxDI class (``g4.serve.nxdi_gemma4``) at TP ``tp`` with
    ``torch_dtype=dtype``. Computed from the architecture's source inventory (:meth:`g4.core.gemma4.Architecture.layer_tensor_shapes`,
    sources in ``dtype``) through this table's entries and rules. The same on every rank. The
    runtime loader checks rank files against it and the memory plan's Neuron weight bytes are
    its ``nbytes`` (``g4.convert.plan``).

    Args:
        config: ``config.json`` of the source (any form :func:`geometry` reads).
        tp: tensor-parallel degree.
        quantize_attention: q/k/v/o int8 (``--quantize-attention``), else in ``dtype``.
        dtype: dtype of the source tensors kept as they are (bf16 for a Gemma 4 release).
        lm_head: a key of :data:`LM_HEAD_LAYOUTS` (``g4convert int8-neuron`` writes ``int8-sharded``).

    Raises:
        G4Error: a TP degree the model cannot be split over.
    """
    g = geometry(config, tp)
    specs: list[TensorSpec] = []
    for L in range(g.num_layers):
        shapes = g.arch.layer_tensor_shapes(L)
        for e in layer_entries(has_v=g.has_v[L], quantize_attention=quantize_attention):
            specs += entry_specs(e, layer_prefix(L), shapes.get(e.source, ()), dtype, g, L)
    model_shapes = g.arch.model_tensor_shapes()
    for e in model_entries(tied=g.arch.tied, lm_head=lm_head):
        specs += entry_specs(e, "", model_shapes.get(e.source, ()), dtype, g, None)
    return specs


@dataclass(frozen=True)
class RankMajor:
    """The layout ``g4convert int8-neuron`` quantizes an expert weight straight into: called on
    the int8 codes (Hugging Face layout ``[E, out, in]``) it returns every rank's tensor at once,
    ``[T, *local]`` contiguous (``rule.rank_major``, from ``rule.rank_split``), so one compiled
    pass reads the bf16 source and writes each rank's codes where the rank file wants them, with
    no per-rank gather and no transposed copy in the writer. Hashable: the key of its compiled
    kernel (``g4.quantizers.int8.quantize_to_layout``)."""

    rule: Rule
    tp: int

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rule.rank_major(codes, self.tp)


@dataclass(frozen=True)
class RankMajorInt8:
    """An int8 weight already laid out per rank (:class:`RankMajor`).

    Attributes:
        weight: int8 ``[T, *local]``: ``weight[r]`` is rank r's tensor (contiguous).
        scale: float32 ``[..., out, 1]`` in the Hugging Face layout (split by the rule's ``take``).
    """

    weight: torch.Tensor
    scale: torch.Tensor


def rank_major_layout(e: Entry, g: Geometry) -> RankMajor | None:
    """The layout an int8 entry's codes can be quantized straight into (the experts'), or None."""
    if not e.int8 or e.rule.rank_major is None:
        return None
    return RankMajor(e.rule, g.tp)


def shard(e: Entry, value: torch.Tensor | Int8Weight | RankMajorInt8, g: Geometry, layer: int | None, rank: int
          ) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors of entry ``e``: ``[weight, scale]`` for int8 entries, else ``[tensor]``.

    Args:
        value: the full source tensor (Hugging Face layout) or its :class:`Int8Weight`
            (int8 ``[..., out, in]`` with fp32 ``[..., out, 1]`` scales); None for a rank index.

    Returns:
        Tensors in the shapes :func:`entry_specs` gives, views of ``value`` where the rule allows
        (a row slice, a column slice, a transpose; ``ShardedSafetensorsWriter.write`` copies a
        non-contiguous view a few rows at a time), so a rank's share is not copied whole.
    """
    if isinstance(value, RankMajorInt8):  # the codes are already per rank; the scale is split here
        return [value.weight[rank], e.rule.take(None, value.scale, g, layer, rank)[1]]
    w, s = (value.weight, value.scale) if isinstance(value, Int8Weight) else (value, None)
    return [p for p in e.rule.take(w, s, g, layer, rank) if p is not None]


DEQUANT_BLOCK_BYTES = 64 << 20  # fp32 output written per product, so torch's fp32 copy of q stays this small


def dequantized_local(e: Entry, tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, *,
                      transpose: bool = False) -> torch.Tensor:
    """One rank's tensor of entry ``e`` (``tensors``: that rank file's tensors by name) in ``dtype``:
    an int8 entry dequantized as ``q * scale`` in fp32 (the product NxD's quantized layers
    compute, aws-neuron/neuronx-distributed ``quantization/quantization_layers.py``), then cast.
    The product is written into the fp32 result :data:`DEQUANT_BLOCK_BYTES` at a time along the
    first dimension (torch converts ``q`` to fp32 for each product, so a whole-tensor product
    would briefly hold a second fp32 copy of it); elementwise, so the values are the same.

    Args:
        transpose: return the last two dimensions swapped, contiguous (an expert of the NxD
            layout ``[H, 2I/T]`` as Hugging Face's ``[2I/T, H]``), written in the same pass.

    Raises:
        KeyError: the rank file lacks one of the entry's tensors.
    """
    names = e.names(prefix)
    t = tensors[names[0]]
    if not e.int8:
        return (t.mT.contiguous() if transpose else t).to(dtype)
    scale = tensors[names[1]]
    if transpose:
        t, scale = t.mT, scale.mT
    shape = torch.broadcast_shapes(t.shape, scale.shape)
    t, scale = t.expand(shape), scale.expand(shape)
    out = torch.empty(shape, dtype=torch.float32)  # int8 weights are [..., out, in]: at least 2-D
    step = max(1, DEQUANT_BLOCK_BYTES // max(1, out[0].numel() * 4))
    for a in range(0, shape[0], step):
        torch.mul(t[a : a + step], scale[a : a + step], out=out[a : a + step])
    return out.to(dtype)


def unshard(e: Entry, parts: list[torch.Tensor], g: Geometry, layer: int | None) -> torch.Tensor:
    """The whole source tensor (Hugging Face layout) of entry ``e`` from every rank's local
    tensor (:func:`dequantized_local`, rank order): the inverse of :func:`shard`."""
    return e.rule.gather(parts, g, layer)


def host_rows(out_dir: str | Path, host_embedding: dict, ids: torch.Tensor) -> torch.Tensor:
    """Rows of the host embedding table (``manifest.host_embedding``: file and tensor under
    ``out_dir``) for int64 token ``ids`` of any shape: ``[*ids.shape, H]`` in the table's dtype,
    unscaled. Only the rows of the distinct ids are read from the file.

    Raises:
        CheckpointError: the table cannot be read.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(out_dir) / host_embedding["file"]
    unique, inverse = torch.unique(ids, return_inverse=True)
    try:
        with safe_open(path, framework="pt") as f:
            rows = f.get_slice(host_embedding["tensor"])
            picked = torch.cat([rows[i : i + 1] for i in unique.tolist()])
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: unreadable host embedding table ({type(e).__name__}: {e})") from e
    return picked[inverse]


# --------------------------------------------------------------------------- manifest


LAYOUT_DESCRIPTION = {
    "names": "the state_dict() of g4's NxD Inference class (NeuronGemma4MoEModel) at this TP degree: "
             "moe.router.*, moe.expert_mlps.mlp_op.*, rank_util.rank and moe.expert_mlps.spmd_rank.rank "
             "(int32 [rank]), embed_tokens.weight [V, H/T] (unscaled bf16)",
    "experts.gate_up_proj": "int8 [E, H, 2I/T] = [gate_r | up_r] (NxD ExpertFusedColumnParallelLinear, "
                            "stride 2), scale fp32 [E, 1, 2I/T]",
    "experts.down_proj": "int8 [E, I/T, H] (NxD ExpertFusedRowParallelLinear), scale fp32 [E, 1, H] "
                         "replicated",
    "column": "weight [out/T, in], scale [out/T, 1]: q/k/v, mlp.gate/up, lm_head",
    "row": "weight [out, in/T], scale [out, 1] replicated: o_proj, mlp.down",
    "source": "aws-neuron/neuronx-distributed trace/trace.py create_local_weight; "
              "quantization/quantization_layers.py",
}


@dataclass
class Manifest:
    """``manifest.json`` of an int8-neuron result: written by :meth:`write`, read back (and its
    format checked) by :meth:`from_dir`; fields in file order."""

    tp_degree: int
    rank_files: list[str]
    host_embedding: dict
    embed_scale: float
    quantization: dict
    layout: dict
    kv_heads: list[dict]
    source: dict
    memory_plan: dict | None
    format: str = LAYOUT_NAME
    # Serving shape (NxDI ``NeuronConfig``: ``max_length`` = ``seq_len``, ``max_context_length``,
    # bucket ladders), written since the NxDI serving path; ``None`` in results written before, see
    # :meth:`serving_shape` (``max_context_length`` was ``max_length`` until it was a field).
    max_length: int | None = None
    context_encoding_buckets: list[int] | None = None
    token_generation_buckets: list[int] | None = None
    max_context_length: int | None = None

    @classmethod
    def build(cls, g: Geometry, *, embed_dtype: torch.dtype, quantize_attention: bool, not_exported: list[str],
              source: dict, memory_plan: dict | None, max_length: int, max_context_length: int | None = None,
              algorithm: str = "max", algorithm_detail: str = "", calibration_tokens: int = 0) -> "Manifest":
        """The manifest of a conversion of ``g`` (architecture at TP ``g.tp``), to be served for
        ``max_length`` tokens (prompt plus reply) and prompts of at most ``max_context_length``
        (default: :func:`serving_max_context_length`) with NxDI's default bucket ladders
        (:func:`neuron_buckets`): context encoding up to ``max_context_length``, token generation
        up to ``max_length``; ``algorithm``: how
        the int8 codes were chosen under the per-channel scales (``g4convert int8-neuron
        --algorithm``: ``max`` or ``gptq``, described by ``algorithm_detail``), ``gptq`` on
        ``calibration_tokens`` tokens."""
        tp = g.tp
        how = {"algorithm": algorithm, "algorithm_detail": algorithm_detail}
        if algorithm == "gptq":
            how["calibration_tokens"] = calibration_tokens
        prompt = serving_max_context_length(max_context_length, max_length)
        return cls(
            max_length=max_length, max_context_length=prompt, context_encoding_buckets=neuron_buckets(prompt),
            token_generation_buckets=neuron_buckets(max_length),
            tp_degree=tp, rank_files=[rank_file(r) for r in range(tp)],
            host_embedding={"file": EMBED_FILE, "tensor": EMBED_TENSOR, "dtype": str(KEPT_DTYPE).removeprefix("torch."),
                            "scaled": False},
            embed_scale=embed_scale(g.hidden, embed_dtype),
            quantization={"type": "per_channel_symmetric", "dtype": "int8", "scale_dtype": "float32",
                          "scale": "absmax/127 per output channel, floored at float32 eps",
                          "experts": "expert_wise_per_channel_symmetric (scales [E,1,out])",
                          "quantized": ["experts", "mlp", "lm_head"] + (["attention"] if quantize_attention else []),
                          "kept_bf16": (["attention"] if not quantize_attention else []) +
                          ["router", "norms", "layer_scalar", "embed_tokens (host)"],
                          "not_exported": not_exported, **how},
            layout=dict(LAYOUT_DESCRIPTION),
            kv_heads=[{"layer": L, "source_kv_heads": g.kv_heads[L], "per_rank": g.kv_per_rank(L),
                       "replicated": g.kv_heads[L] < tp,
                       "rank_first_head": [g.kv_head_of_rank(L, r) for r in range(tp)], "has_v_proj": g.has_v[L]}
                      for L in range(g.num_layers)],
            source=source, memory_plan=memory_plan)

    @property
    def quantize_attention(self) -> bool:
        return "attention" in self.quantization["quantized"]

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps({"format": d.pop("format"), **d}, indent=2) + "\n"

    def write(self, out_dir: str | Path) -> None:
        (Path(out_dir) / MANIFEST).write_text(self.to_json())

    @classmethod
    def from_dir(cls, out_dir: str | Path) -> "Manifest":
        """Read ``out_dir/manifest.json``.

        Raises:
            CheckpointError: missing, not JSON, another format, or a missing field.
        """
        path = Path(out_dir) / MANIFEST
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != LAYOUT_NAME:
                raise CheckpointError(f"{path}: unknown layout {raw.get('format')!r} (expected {LAYOUT_NAME!r})")
            fields = cls.__dataclass_fields__
            names = [f for f in fields if f in raw or fields[f].default is MISSING]
            missing = [f for f in names if f not in raw]
            if missing:
                raise CheckpointError(f"{path}: missing {', '.join(missing)}")
            return cls(**{f: raw[f] for f in names})
        except (OSError, ValueError, AttributeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{Path(out_dir)}: not a readable int8-neuron result ({type(e).__name__}: {e})") from e

    def serving_shape(self, max_positions: int | None) -> tuple[int, list[int], list[int]]:
        """``(max_length, context_encoding_buckets, token_generation_buckets)`` to compile and serve
        with (tokens); the largest context-encoding bucket is the longest prompt
        (``max_context_length``). A manifest written before these fields existed gets the length
        its memory plan sized the KV cache for (``memory_plan.inputs.seq_len``;
        :data:`DEFAULT_MAX_LENGTH` without a plan), capped at ``max_positions``, and
        :func:`neuron_buckets` of it for both; one written before ``max_context_length`` existed
        encodes prompts up to ``max_length``, as it was compiled then.

        Raises:
            CheckpointError: a length or bucket that is not a positive integer, buckets not
                ascending, a largest token-generation bucket other than ``max_length``, or a
                largest context-encoding bucket other than ``max_context_length`` (at most
                ``max_length``).
        """
        plan = ((self.memory_plan or {}).get("inputs") or {}).get("seq_len")
        length = self.max_length if self.max_length is not None else min(
            plan or DEFAULT_MAX_LENGTH, max_positions or plan or DEFAULT_MAX_LENGTH)
        prompt = self.max_context_length if self.max_context_length is not None else length
        cte = self.context_encoding_buckets or neuron_buckets(prompt)
        tkg = self.token_generation_buckets or neuron_buckets(length)
        for what, value, top, name in (("max_length", [length], length, "max_length"),
                                       ("max_context_length", [prompt], prompt, "max_context_length"),
                                       ("context_encoding_buckets", cte, prompt, "max_context_length"),
                                       ("token_generation_buckets", tkg, length, "max_length")):
            if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value) or \
                    value != sorted(set(value)) or value[-1] != top:
                raise CheckpointError(f"{MANIFEST}: {what} {value!r}: positive integers, ascending, the largest "
                                      f"equal to {name} {top!r}")
        if prompt > length:
            raise CheckpointError(f"{MANIFEST}: max_context_length {prompt} is longer than max_length {length}")
        return length, list(cte), list(tkg)

    def check_embed_scale(self, arch: Architecture, where) -> float:
        """:attr:`embed_scale`, checked against ``bf16(sqrt(hidden_size))`` from the config (what
        ``Gemma4TextScaledWordEmbedding`` multiplies by; case P12: a dropped or double scale
        gives wrong output that a small end-to-end check may not notice).

        Raises:
            CheckpointError: missing or different value (naming ``where``).
        """
        expected = embed_scale(arch.hidden)
        got = self.embed_scale
        if not isinstance(got, (int, float)) or isinstance(got, bool) or float(got) != expected:
            raise CheckpointError(f"{where}: embed_scale {got!r}, but hidden_size {arch.hidden} needs "
                                  f"bf16(sqrt({arch.hidden})) = {expected:g} (P12)")
        return expected


def check_rank_files(out_dir: str | Path, ranks: list[int] | None = None, *, host: bool = True,
                     dtype: torch.dtype = torch.bfloat16) -> tuple[Manifest, dict, list[Path]]:
    """Check a finished int8-neuron result against this table from its headers and JSON alone
    (no tensor is read): ``manifest.json`` (:meth:`Manifest.from_dir`; one rank file per TP rank
    under the names :func:`rank_file` gives, :meth:`Manifest.check_embed_scale`,
    :meth:`Manifest.serving_shape`), and every rank file's names, dtypes and per-rank shapes
    exactly :func:`expected_rank_specs` of ``config.json``, and the host embedding table
    (``manifest.host_embedding``: :data:`EMBED_TENSOR`, ``[vocab_size, hidden_size]``) in ``dtype``.

    Args:
        out_dir: the result directory.
        ranks: the rank files to check (default: all of them); the manifest is always checked.
        host: also check the host embedding table (a rank's own loader reads only its rank file).
        dtype: dtype of the tensors kept as the source stored them (bf16 for a Gemma 4 release).

    Returns:
        ``(manifest, config, paths)``: the manifest, ``config.json`` and the checked rank files'
        paths, in the order of ``ranks``.

    Raises:
        CheckpointError: an unreadable or inconsistent manifest or config, a missing or corrupt
            file, or a rank file (or the host table) that differs from the table: one line naming
            the file, the tensor and what differs.
    """
    out_dir = Path(out_dir)
    manifest = Manifest.from_dir(out_dir)
    config = read_json_object(out_dir / CONFIG_NAME)
    tp = manifest.tp_degree
    want_files = [rank_file(r) for r in range(tp)] if isinstance(tp, int) and tp > 0 else None
    if manifest.rank_files != want_files:
        raise CheckpointError(f"{out_dir / MANIFEST}: rank_files {manifest.rank_files!r} are not the {tp!r} files "
                              f"{want_files!r} of tp_degree {tp!r}")
    g = geometry(config, tp)
    manifest.check_embed_scale(g.arch, out_dir / MANIFEST)
    text = config.get("text_config") or config
    manifest.serving_shape(text.get("max_position_embeddings"))

    def check_file(path: Path, expected: dict[str, tuple[torch.dtype, tuple[int, ...]]], what: str) -> None:
        if not path.is_file():
            raise CheckpointError(f"{path}: {what} is missing")
        header = read_safetensors_header(path)  # truncated or corrupt file: one clear error
        extra, missing = sorted(set(header) - set(expected)), sorted(set(expected) - set(header))
        if extra or missing:
            raise CheckpointError(f"{path}: keys differ from the layout table (missing {missing[:3]}, "
                                  f"unexpected {extra[:3]})")
        for name in sorted(header):
            have, want = header[name], expected[name]
            if (have.dtype, tuple(have.shape)) != want:
                raise CheckpointError(f"{path}: tensor {name} is {have.dtype} {list(have.shape)}, the layout says "
                                      f"{want[0]} {list(want[1])} for {what}")

    specs = {s.name: (s.dtype, tuple(s.shape)) for s in expected_rank_specs(
        config, tp, quantize_attention=manifest.quantize_attention, dtype=dtype)}
    paths = []
    for rank in range(tp) if ranks is None else ranks:
        if not 0 <= rank < tp:
            raise CheckpointError(f"{out_dir}: no TP rank {rank} (TP degree {tp})")
        paths.append(out_dir / manifest.rank_files[rank])
        check_file(paths[-1], specs, f"rank {rank}")
    if not host:
        return manifest, config, paths
    table = manifest.host_embedding if isinstance(manifest.host_embedding, dict) else {}
    if (table.get("file"), table.get("tensor")) != (EMBED_FILE, EMBED_TENSOR):
        raise CheckpointError(f"{out_dir / MANIFEST}: host_embedding {manifest.host_embedding!r}, expected file "
                              f"{EMBED_FILE!r} holding {EMBED_TENSOR!r}")
    check_file(out_dir / EMBED_FILE, {EMBED_TENSOR: (dtype, (g.arch.vocab, g.hidden))}, "the host embedding table")
    return manifest, config, paths
