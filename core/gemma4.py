"""Gemma 4 MoE architecture facts, read from a config in one place.

Every g4 path (``nvfp4``, ``int8-neuron``, ``plan``, ``synth``, ``verify``, ``g4serve``) reads the
model through :func:`read_architecture` and the constants here: the model types, the layer
types (with transformers' default and the last layer forced to full attention), per-layer
head dims and KV heads in either config form, ``attention_k_eq_v``, tied or untied
embeddings, the embedding scale, the norm names, the source tensor inventory with shapes, and
the gate/up split of the fused experts. Source: huggingface/transformers 5.24
``src/transformers/models/gemma4/configuration_gemma4.py`` and ``modeling_gemma4.py``.

Config forms.

Gemma 4 checkpoints ship in the **release form**: ``text_config.head_dim`` /
``num_key_value_heads`` for the sliding layers, ``global_head_dim`` (default 512) and
``num_global_key_value_heads`` (used only with ``attention_k_eq_v``) for the
full-attention layers. transformers >= 5.15 consumes those two keys in
``Gemma4TextConfig.__post_init__`` and saves the **per_layer_config form** instead:
``text_config.per_layer_config = {"05": {"head_dim": 512, "num_key_value_heads": 2}, ...}``,
keyed by the layer index zero-padded to the widest index, and no release keys
(huggingface/transformers ``src/transformers/models/gemma4/configuration_gemma4.py``,
``integrations/heterogeneity/configuration_utils.py``). vLLM, llama.cpp, MLX and older
transformers read only the release keys (case P17: vllm-project/vllm issues #51744, #52768).

:func:`attention_layers` is the one reader of head dims, KV heads and ``v_proj`` presence
per layer; :func:`release_config` writes a config back in the release form.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from g4.core.errors import G4Error
from g4.quantizers.nvfp4 import BLOCK_SIZE as NVFP4_BLOCK  # inputs per E4M3 block scale, re-exported

MODEL_TYPES = ("gemma4", "gemma4_text")  # Gemma4Config (multimodal) and Gemma4TextConfig
MULTIMODAL_PREFIX = "model.language_model."  # Gemma4ForConditionalGeneration's language model
LM_HEAD = "lm_head.weight"  # an untied model's output projection [V, H] (transformers' and NxDI's name)
TEXT_PREFIX = "model."  # Gemma4ForCausalLM
# The seven RMSNorms of a Gemma 4 MoE decoder layer (Gemma4TextDecoderLayer), in its order:
# input/post attention, the dense MLP's pre/post (post_..._1), the experts' pre/post (_2), and
# the post-feedforward norm over their sum.
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2",
)
ATTENTION_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# Gemma4TextConfig / Gemma4Config: tie_word_embeddings=True unless the config says otherwise.
TIE_WORD_EMBEDDINGS_DEFAULT = True
# Fused expert tensors as stored (no ".weight" suffix): gate_up [E, 2I, H] = [gate; up], down [E, H, I].
EXPERT_GATE_UP = "experts.gate_up_proj"
EXPERT_DOWN = "experts.down_proj"

# What each module of a decoder layer is part of (module name relative to the layer -> part),
# and of the language model outside the layers; the model card's rows and every name test
# read these exact names, never substrings.
LAYER_MODULE_KINDS: dict[str, str] = {
    **{n: "norms" for n in LAYER_NORMS + ATTENTION_NORMS},
    **{f"self_attn.{p}_proj": "attention" for p in "qkvo"},
    **{f"mlp.{p}_proj": "dense MLP" for p in ("gate", "up", "down")},
    "router.proj": "routers", "router.scale": "routers", "router.per_expert_scale": "routers",
    "layer_scalar": "layer scalars",
    EXPERT_GATE_UP: "experts", EXPERT_DOWN: "experts",
}
MODEL_MODULE_KINDS: dict[str, str] = {"embed_tokens": "token embedding", "norm": "norms", "lm_head": "lm_head"}
TOWERS_KIND = "vision tower and embed_vision"
# Sub-trees of a multimodal checkpoint outside the language model (vision first).
TOWER_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
VISION_PREFIXES = TOWER_PREFIXES[:2]


def tower_of(name: str) -> str | None:
    """The tower prefix (:data:`TOWER_PREFIXES`) a tensor lies under, or None.

    A prefix test, on purpose: g4 does not model the towers' own inventory (the vision and
    audio configs), so a tower is a sub-tree whose tensors are kept as the source stores
    them; which tensors it holds is read from the file (the source, or OUT when checked)."""
    return next((t for t in TOWER_PREFIXES if name.startswith(t)), None)

RELEASE_GLOBAL_HEAD_DIM_DEFAULT = 512  # Gemma4TextConfig.__post_init__: global_head_dim = kwargs.pop(..., 512)
_OVERRIDE_KEYS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True)
class AttentionLayer:
    """Attention shape of one decoder layer: ``kv_heads`` KV heads of ``head_dim``;
    ``has_v`` is False on full-attention layers with ``attention_k_eq_v`` (no v_proj)."""

    sliding: bool
    head_dim: int
    kv_heads: int
    has_v: bool

    def kv_per_rank(self, tp: int) -> int:
        """KV heads each of ``tp`` ranks holds (:func:`kv_heads_per_rank`)."""
        return kv_heads_per_rank(self.kv_heads, tp)


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads each of ``tp`` ranks holds for a layer with ``kv_heads`` KV heads: ``kv_heads / tp``,
    or 1 when there are fewer KV heads than ranks and whole heads are replicated (rank r then holds
    head ``r * kv_heads // tp``), as NxDI's GQA ``REPLICATE_TO_TP_DEGREE`` does
    (aws-neuron/neuronx-distributed-inference ``src/neuronx_distributed_inference/modules/attention/gqa.py``,
    ``determine_sharding_strategy`` / ``get_shardable_head_counts``). The one rule of the int8-neuron
    layout, the memory plan's KV cache and g4's NxDI KV cache manager.

    Raises:
        G4Error: ``kv_heads`` does not split evenly over ``tp`` ranks, or is fewer than ``tp`` and
            does not divide it.
    """
    if tp < 1 or kv_heads < 1:
        raise G4Error(f"KV heads {kv_heads} over TP {tp}: both must be >= 1")
    if kv_heads >= tp:
        if kv_heads % tp:
            raise G4Error(f"{kv_heads} KV heads cannot be split evenly over {tp} ranks")
        return kv_heads // tp
    if tp % kv_heads:
        raise G4Error(f"{kv_heads} KV heads cannot be replicated over {tp} ranks ({tp} is not a multiple of {kv_heads})")
    return 1


# The text-config keys :func:`attention_layers` reads (release form), for readers that hold the
# config as attributes (NxDI's InferenceConfig) rather than as a dict.
ATTENTION_CONFIG_KEYS = ("num_hidden_layers", "layer_types", "head_dim", "num_key_value_heads", "global_head_dim",
                         "num_global_key_value_heads", "attention_k_eq_v")


@dataclass(frozen=True)
class KvCacheLayer:
    """The K (and, with the same shape, the V) cache of one decoder layer on one rank:
    ``heads`` KV heads per rank (:func:`kv_heads_per_rank`) of ``head_dim``; ``sliding`` marks a
    sliding-window layer. K and V are both cached on k_eq_v full layers (they are normalised and
    roped differently)."""

    sliding: bool
    heads: int
    head_dim: int


def kv_cache_layers(layers, tp: int) -> tuple[KvCacheLayer, ...]:
    """Per-layer KV cache geometry on one of ``tp`` ranks, from :func:`attention_layers` (sliding
    layers: ``num_key_value_heads`` x ``head_dim``; full layers: ``num_global_key_value_heads`` (with
    ``attention_k_eq_v``) x ``global_head_dim``). Read by the memory plan
    (``g4.convert.plan.kv_cache_nxdi``) and by g4's NxDI KV cache manager
    (``g4.serve.nxdi_gemma4.Gemma4KVCacheManager``), so the planned and the allocated cache agree.

    Args:
        layers: the :class:`AttentionLayer` s of a model, in layer order.
        tp: tensor-parallel degree.

    Raises:
        G4Error: a layer's KV heads cannot be placed on ``tp`` ranks (:func:`kv_heads_per_rank`).
    """
    return tuple(KvCacheLayer(a.sliding, kv_heads_per_rank(a.kv_heads, tp), a.head_dim) for a in layers)


def kv_cache_positions(layers, max_length: int, sliding_window: int | None) -> tuple[int, ...]:
    """Positions each layer's KV cache holds in g4's NxDI model class, per sequence: a full layer
    ``max_length``; a sliding layer ``min(sliding_window - 1, max_length)``, a ring of the positions
    a new token can still attend to besides itself (``q - k < sliding_window``: the window minus the
    token), written at ``position % positions``. Read by the class
    (``g4.serve.nxdi_gemma4.NeuronGemma4MoEModel``, its ``layer_to_cache_size_mapping``) and by the
    memory plan (``g4.convert.plan.kv_cache_nxdi``), so the planned and the allocated cache agree.

    Args:
        layers: the :class:`AttentionLayer` s of a model, in layer order.
        max_length: the longest sequence the engine runs (NxDI's ``max_length``), positions.
        sliding_window: the config's ``sliding_window``, positions (None: no sliding layers).

    Raises:
        G4Error: ``max_length`` < 1, or a sliding layer with a window below 2.
    """
    if max_length < 1:
        raise G4Error(f"max_length {max_length}: at least one position")
    out = []
    for a in layers:
        if not a.sliding:
            out.append(max_length)
            continue
        if not sliding_window or sliding_window < 2:
            raise G4Error(f"sliding_window {sliding_window!r}: a sliding layer needs a window of at least 2 positions")
        out.append(min(sliding_window - 1, max_length))
    return tuple(out)


def text_config_of(config: dict) -> dict:
    """The text sub-config of a multimodal config (``text_config``), or ``config`` itself."""
    return config.get("text_config") or config


def layer_types(tc: dict) -> list[str]:
    """``layer_types`` as transformers 5.24 builds it: 5 sliding : 1 full when absent, and the
    last layer forced to ``full_attention``.

    Raises:
        G4Error: ``layer_types`` does not have one entry per layer.
    """
    n = tc.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise G4Error(f"text config: num_hidden_layers is {n!r}, expected a positive integer")
    types = list(tc.get("layer_types") or
                 ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)])
    if len(types) != n:
        raise G4Error(f"text config: {len(types)} layer_types for {n} layers")
    odd = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if odd:
        raise G4Error(f"text config: layer_types has {odd[0]!r}; Gemma 4 layers are 'sliding_attention' or "
                      "'full_attention'")
    types[-1] = "full_attention"
    return types


def _per_layer_overrides(tc: dict, n_layers: int) -> dict[int, dict]:
    raw = tc.get("per_layer_config") or {}
    if not isinstance(raw, dict):
        raise G4Error(f"text config: per_layer_config is {type(raw).__name__}, expected an object keyed by layer index")
    out: dict[int, dict] = {}
    for key, over in raw.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            index = -1
        if not 0 <= index < n_layers or not isinstance(over, dict):
            raise G4Error(f"text config: per_layer_config entry {key!r} is not a layer index in [0, {n_layers}) "
                          "with an object of overrides")
        if index in out:
            raise G4Error(f"text config: per_layer_config names layer {index} twice")
        out[index] = over
    return out


def attention_layers(config: dict) -> tuple[AttentionLayer, ...]:
    """Per-layer head dim, KV heads and ``v_proj`` presence of a Gemma 4 config, in either form.

    ``config`` is a multimodal config (with ``text_config``) or a text config. Follows
    transformers 5.24: when ``per_layer_config`` is present (even empty) it is the whole
    truth and ``global_head_dim`` / ``num_global_key_value_heads`` are ignored; otherwise
    full-attention layers get ``global_head_dim`` (default 512) and, only with
    ``attention_k_eq_v``, ``num_global_key_value_heads`` KV heads.

    Raises:
        G4Error: a missing or non-positive size, or a malformed ``per_layer_config``.
    """
    tc = text_config_of(config)

    def positive(where: str, value) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise G4Error(f"text config: {where} is {value!r}, expected a positive integer")
        return value

    types = layer_types(tc)
    head_dim = positive("head_dim", tc.get("head_dim"))
    kv = positive("num_key_value_heads", tc.get("num_key_value_heads"))
    k_eq_v = bool(tc.get("attention_k_eq_v", False))
    per_layer = "per_layer_config" in tc
    overrides = _per_layer_overrides(tc, len(types)) if per_layer else {}
    layers = []
    for i, t in enumerate(types):
        full = t == "full_attention"
        if per_layer:
            over = overrides.get(i, {})
            hd = positive(f"per_layer_config[{i}].head_dim", over.get("head_dim", head_dim))
            kvh = positive(f"per_layer_config[{i}].num_key_value_heads", over.get("num_key_value_heads", kv))
        elif full:
            hd = positive("global_head_dim", tc.get("global_head_dim") or RELEASE_GLOBAL_HEAD_DIM_DEFAULT)
            g_kv = tc.get("num_global_key_value_heads") if k_eq_v else None
            kvh = kv if g_kv is None else positive("num_global_key_value_heads", g_kv)
        else:
            hd, kvh = head_dim, kv
        layers.append(AttentionLayer(sliding=not full, head_dim=hd, kv_heads=kvh, has_v=not (full and k_eq_v)))
    return tuple(layers)


def release_config(config: dict) -> dict:
    """A copy of ``config`` in the release form: ``per_layer_config`` replaced by
    ``global_head_dim`` and ``num_global_key_value_heads`` (in its place; every other key
    and the key order kept). A config already in the release form is returned unchanged
    (as a copy). The result reads back, in g4 and in transformers 5.24, to the same
    :func:`attention_layers`.

    Raises:
        G4Error: a ``per_layer_config`` the release form cannot express (overrides other
            than ``head_dim`` / ``num_key_value_heads``, sliding layers that differ from the
            base sizes, full layers that differ from each other, or a full-layer KV-head
            override without ``attention_k_eq_v``).
    """
    config = copy.deepcopy(config)
    tc = text_config_of(config)
    if "per_layer_config" not in tc:
        return config
    layers = attention_layers(config)
    why = "g4 writes the release form (global_head_dim / num_global_key_value_heads) that vLLM reads"
    for key, over in (tc.get("per_layer_config") or {}).items():
        extra = sorted(set(over) - set(_OVERRIDE_KEYS))
        if extra:
            raise G4Error(f"text config: per_layer_config[{key!r}] overrides {', '.join(extra)}; {why}, which has "
                          "no such per-layer keys")
    base = (tc["head_dim"], tc["num_key_value_heads"])
    odd = [i for i, a in enumerate(layers) if a.sliding and (a.head_dim, a.kv_heads) != base]
    if odd:
        raise G4Error(f"text config: per_layer_config changes sliding layer {odd[0]}; {why}, where sliding layers "
                      f"all have head_dim {base[0]} and {base[1]} KV heads")
    full = {(a.head_dim, a.kv_heads) for a in layers if not a.sliding}
    if len(full) != 1:
        raise G4Error(f"text config: per_layer_config gives the full-attention layers different sizes {sorted(full)}; "
                      f"{why}, which has one size for all of them")
    (g_head_dim, g_kv), = full
    k_eq_v = bool(tc.get("attention_k_eq_v", False))
    if not k_eq_v and g_kv != base[1]:
        raise G4Error(f"text config: per_layer_config gives full-attention layers {g_kv} KV heads without "
                      f"attention_k_eq_v; {why}, where num_global_key_value_heads applies only with attention_k_eq_v")
    rewritten = {}
    for key, value in tc.items():
        if key == "per_layer_config":
            rewritten["global_head_dim"] = g_head_dim
            rewritten["num_global_key_value_heads"] = g_kv if k_eq_v else None
        elif key not in ("global_head_dim", "num_global_key_value_heads"):
            rewritten[key] = value
    tc.clear()
    tc.update(rewritten)
    return config


def is_tied(config: dict) -> bool:
    """``tie_word_embeddings`` of a Gemma 4 config: the text config's, else the top level's,
    else :data:`TIE_WORD_EMBEDDINGS_DEFAULT` (true, as transformers' Gemma 4 configs)."""
    tc = text_config_of(config)
    return bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", TIE_WORD_EMBEDDINGS_DEFAULT)))


def _check_tie(config: dict) -> None:
    """``tie_word_embeddings`` must be a JSON boolean, and the top level and ``text_config`` must
    not disagree: transformers ties by one, g4 would read the other (case P06)."""
    tc = text_config_of(config)
    levels = {where: c["tie_word_embeddings"] for where, c in (("", config), ("text_config.", tc))
              if "tie_word_embeddings" in c}
    for where, value in levels.items():
        if not isinstance(value, bool):
            raise G4Error(f"{where}tie_word_embeddings is {value!r}, expected true or false")
    if len(set(levels.values())) > 1:
        raise G4Error("tie_word_embeddings is " + " but ".join(f"{json.dumps(v)} at {w.rstrip('.') or 'the top level'}"
                                                               for w, v in levels.items())
                      + "; loaders disagree on such configs (case P06): make them agree")


def embed_scale(hidden_size: int, dtype=None) -> float:
    """The embedding scale as ``Gemma4TextScaledWordEmbedding`` applies it: ``sqrt(H)`` cast to
    the weight dtype (default bfloat16): 53.0 for H = 2816 in bf16, not 53.066 (case P12)."""
    import torch

    return float(torch.tensor(hidden_size**0.5).to(dtype or torch.bfloat16))


def split_gate_up(gate_up):
    """``(gate, up)`` of a fused ``gate_up_proj`` ``[..., 2I, H]``: rows ``[0, I)`` and ``[I, 2I)``."""
    inter = gate_up.shape[-2] // 2
    return gate_up[..., :inter, :], gate_up[..., inter:, :]


@dataclass(frozen=True)
class Architecture:
    """A Gemma 4 MoE text model as its config describes it (element counts).

    ``layers[L]``: attention shape of layer L (sliding or full, head dim, KV heads, ``v_proj``
    present); ``tied``: lm_head is ``embed_tokens`` (no ``lm_head.weight`` stored).
    """

    model_type: str
    hidden: int
    heads: int
    layers: tuple[AttentionLayer, ...]
    intermediate: int
    moe_intermediate: int
    experts: int
    top_k: int
    vocab: int
    tied: bool
    k_eq_v: bool
    sliding_window: int
    max_positions: int | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def multimodal(self) -> bool:
        return self.model_type == "gemma4"

    @property
    def layer_types(self) -> list[str]:
        return ["sliding_attention" if a.sliding else "full_attention" for a in self.layers]

    def embed_scale(self, dtype=None) -> float:
        """:func:`embed_scale` of this model's hidden size."""
        return embed_scale(self.hidden, dtype)

    def layer_tensor_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Source tensors of decoder layer ``layer`` (suffix relative to the layer -> shape), as
        transformers stores them: ``v_proj`` only where the layer has one (not on k_eq_v full
        attention layers, case P08), fused experts ``[E, 2I, H]`` / ``[E, H, I]``."""
        a, H = self.layers[layer], self.hidden
        shapes: dict[str, tuple[int, ...]] = {f"{n}.weight": (H,) for n in LAYER_NORMS}
        shapes |= {f"{n}.weight": (a.head_dim,) for n in ATTENTION_NORMS}
        shapes |= {"self_attn.q_proj.weight": (self.heads * a.head_dim, H),
                   "self_attn.k_proj.weight": (a.kv_heads * a.head_dim, H)}
        if a.has_v:
            shapes["self_attn.v_proj.weight"] = (a.kv_heads * a.head_dim, H)
        shapes |= {"self_attn.o_proj.weight": (H, self.heads * a.head_dim),
                   "mlp.gate_proj.weight": (self.intermediate, H), "mlp.up_proj.weight": (self.intermediate, H),
                   "mlp.down_proj.weight": (H, self.intermediate),
                   "router.proj.weight": (self.experts, H), "router.scale": (H,),
                   "router.per_expert_scale": (self.experts,),
                   EXPERT_GATE_UP: (self.experts, 2 * self.moe_intermediate, H),
                   EXPERT_DOWN: (self.experts, H, self.moe_intermediate), "layer_scalar": (1,)}
        return shapes

    def model_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Language-model tensors outside the decoder layers (relative to its prefix; an untied
        model's ``lm_head.weight`` is top level in the checkpoint, listed here under that name)."""
        shapes = {"embed_tokens.weight": (self.vocab, self.hidden), "norm.weight": (self.hidden,)}
        if not self.tied:
            shapes[LM_HEAD] = (self.vocab, self.hidden)
        return shapes

    def kv_per_rank(self, layer: int, tp: int) -> int:
        """KV heads each of ``tp`` ranks holds for ``layer`` (1 when whole heads are replicated)."""
        return self.layers[layer].kv_per_rank(tp)

    def kv_head_of_rank(self, layer: int, rank: int, tp: int) -> int:
        """First source KV head on ``rank``: the one its first query head attends with."""
        return (rank * (self.heads // tp)) // (self.heads // self.layers[layer].kv_heads)


def _positive(tc: dict, key: str) -> int:
    value = tc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise G4Error(f"text config {key} is {value!r}, expected a positive integer")
    return value


HIDDEN_ACTIVATION = "gelu_pytorch_tanh"  # Gemma4TextConfig's default and every release's value


def _check_activation(tc: dict) -> None:
    """``hidden_activation`` (dense MLP and experts) must be one transformers computes
    (``transformers.activations.ACT2CLS``), or every command that runs the model fails later.
    Gemma 4's own activation is taken without importing transformers (1.3 s of a conversion's
    start on the 2-core machine here, before any byte is read); tests check it is in ACT2CLS."""
    act = tc.get("hidden_activation", HIDDEN_ACTIVATION)
    if act == HIDDEN_ACTIVATION:
        return
    from transformers.activations import ACT2CLS

    if not isinstance(act, str) or act not in ACT2CLS:
        raise G4Error(f"text config: hidden_activation {act!r} is not an activation transformers computes "
                      f"(Gemma 4 uses {HIDDEN_ACTIVATION!r})")


def read_architecture(config: dict) -> Architecture:
    """The one reader and validator of a Gemma 4 MoE config, in the release or the
    ``per_layer_config`` form; ``config`` is multimodal (with ``text_config``) or a text config
    (a text config without ``model_type`` is taken as ``gemma4_text``).

    Raises:
        G4Error: not a Gemma 4 MoE config, a missing or non-positive size, a malformed
            ``layer_types`` / ``per_layer_config``, an activation transformers does not compute,
            or a layout g4 does not model (per-layer embeddings, KV-shared layers).
    """
    if not isinstance(config, dict):
        raise G4Error(f"config must be a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type", "gemma4_text" if "text_config" not in config else None)
    if model_type not in MODEL_TYPES:
        raise G4Error(f"model_type is {model_type!r}, expected {' or '.join(map(repr, MODEL_TYPES))} (Gemma 4)")
    tc = text_config_of(config)
    if not isinstance(tc, dict) or not tc.get("enable_moe_block", False):
        raise G4Error("text config has no MoE block (enable_moe_block is not true); g4 handles Gemma 4 MoE models")
    if tc.get("hidden_size_per_layer_input") or tc.get("num_kv_shared_layers"):
        raise G4Error("per-layer embeddings (hidden_size_per_layer_input) and KV-shared layers "
                      "(num_kv_shared_layers) are not supported by g4")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "moe_intermediate_size", "num_experts", "top_k_experts", "vocab_size",
                "sliding_window"):
        _positive(tc, key)
    if tc["top_k_experts"] > tc["num_experts"]:
        raise G4Error(f"text config: top_k_experts {tc['top_k_experts']} is more than num_experts {tc['num_experts']}")
    _check_activation(tc)
    _check_tie(config)
    return Architecture(
        model_type=model_type, hidden=tc["hidden_size"], heads=tc["num_attention_heads"],
        layers=attention_layers(tc), intermediate=tc["intermediate_size"],
        moe_intermediate=tc["moe_intermediate_size"], experts=tc["num_experts"], top_k=tc["top_k_experts"],
        vocab=tc["vocab_size"], tied=is_tied(config), k_eq_v=bool(tc.get("attention_k_eq_v", False)),
        sliding_window=tc["sliding_window"], max_positions=tc.get("max_position_embeddings"))




def tp_problems(arch: Architecture, tp: int, *, fmt: str = "bf16") -> list[str]:
    """Why ``tp`` cannot be mapped onto ``arch`` (empty when it can): the one TP rule set of the
    memory plan and the int8-neuron layout.

    Heads, dense and expert intermediate sizes and the vocabulary must divide by ``tp``;
    a layer's KV heads must divide by ``tp`` or, when fewer, divide ``tp`` (replication).
    For NVFP4 each rank's share of a row-parallel input must be whole 16-element blocks.
    """
    if tp < 1:
        return [f"must be >= 1, got {tp}"]
    problems = [f"{name} {n} is not divisible by {tp}" for name, n in (
        ("num_attention_heads", arch.heads), ("intermediate_size", arch.intermediate),
        ("moe_intermediate_size", arch.moe_intermediate), ("vocab_size", arch.vocab)) if n % tp]
    for kv in sorted({layer.kv_heads for layer in arch.layers}):
        if tp <= kv and kv % tp:
            problems.append(f"{kv} KV heads cannot be split evenly over {tp} ranks")
        elif tp > kv and tp % kv:
            problems.append(f"{kv} KV heads cannot be replicated over {tp} ranks ({tp} is not a multiple of {kv})")
    if fmt == "nvfp4" and not problems:
        rows = [("moe_intermediate_size", arch.moe_intermediate // tp), ("intermediate_size", arch.intermediate // tp),
                ("hidden_size", arch.hidden)]
        rows += [(f"attention heads x head_dim {layer.head_dim}", arch.heads // tp * layer.head_dim)
                 for layer in arch.layers]
        problems += sorted({f"{what}: {n} inputs per rank is not a multiple of the NVFP4 block of {NVFP4_BLOCK}"
                            for what, n in rows if n % NVFP4_BLOCK})
    return problems


def valid_tp_degrees(arch: Architecture, *, fmt: str = "bf16") -> list[int]:
    """Every TP degree from 1 to the number of attention heads that ``arch`` can be split over
    (:func:`tp_problems` finds nothing)."""
    return [t for t in range(1, arch.heads + 1) if not tp_problems(arch, t, fmt=fmt)]


def tp_refusal(arch: Architecture, tp: int, *, fmt: str = "bf16") -> str | None:
    """Why ``tp`` cannot be mapped onto ``arch`` and the degrees that can, for an error message
    (``g4convert plan`` and the int8-neuron layout say the same); None when it can."""
    problems = tp_problems(arch, tp, fmt=fmt)
    if not problems:
        return None
    return f"{'; '.join(problems)} (TP degrees that work: {', '.join(map(str, valid_tp_degrees(arch, fmt=fmt)))})"
