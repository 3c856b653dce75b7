"""Declarative name table: Gemma 4 source tensors -> modelopt NVFP4 checkpoint tensors.

Target names are what modelopt 0.47's ``export_hf_checkpoint`` writes for Gemma 4 and
what every vLLM from 0.19.1 to 0.33 loads unpatched (vllm-project/vllm
``vllm/model_executor/models/gemma4.py``, its ``expert_params_mapping``): per-expert 2-D linears
``…layers.{L}.experts.{E}.{gate_proj|up_proj|down_proj}.{weight|weight_scale|weight_scale_2|input_scale}``,
never ``.moe.``, never fused 3-D NVFP4 tensors.

The table is expanded once per checkpoint into an exact-match dict; a source tensor
with no rule, or a required tensor that is absent, is a :class:`MappingError` (case
P01: nothing fused may pass through unquantized by omission).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from g4.convert.errors import MappingError
from g4.convert.gemma4 import (
    ATTENTION_NORMS,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    LAYER_MODULE_KINDS,
    LAYER_NORMS,
    MODEL_MODULE_KINDS,
    MULTIMODAL_PREFIX,
    TEXT_PREFIX,
    TOWER_PREFIXES,
    TOWERS_KIND,
)

QUANT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class Part(str, Enum):
    """Which quantization preset turns a group on (modelopt's NVFP4 presets)."""

    ATTENTION = "attention"
    MLP = "mlp"
    EXPERTS = "experts"


# --preset name -> parts quantized; mirrors modelopt's NVFP4_DEFAULT_CFG,
# NVFP4_MLP_ONLY_CFG and NVFP4_EXPERTS_ONLY_CFG.
PRESETS: dict[str, frozenset[Part]] = {
    "default": frozenset({Part.ATTENTION, Part.MLP, Part.EXPERTS}),
    "mlp-only": frozenset({Part.MLP, Part.EXPERTS}),
    "experts-only": frozenset({Part.EXPERTS}),
}


@dataclass(frozen=True)
class LinearGroup:
    """Dense linears quantized together: one shared ``weight_scale_2`` and ``input_scale``
    (the max over members), as vLLM's merged qkv / gate_up layers require (vllm-project/vllm
    ``vllm/model_executor/layers/quantization/modelopt.py``)."""

    part: Part
    members: tuple[str, ...]  # module suffixes inside the layer, e.g. "self_attn.q_proj"
    optional: frozenset[str] = field(default_factory=frozenset)


# Dense groups per decoder layer, in output order.
DENSE_GROUPS: tuple[LinearGroup, ...] = (
    # k_eq_v full-attention layers have no v_proj (case P08): never required there.
    LinearGroup(Part.ATTENTION, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                optional=frozenset({"self_attn.v_proj"})),
    LinearGroup(Part.ATTENTION, ("self_attn.o_proj",)),
    LinearGroup(Part.MLP, ("mlp.gate_proj", "mlp.up_proj")),
    LinearGroup(Part.MLP, ("mlp.down_proj",)),
)

# Fused 3-D expert tensors (no ".weight" suffix). Accepted under the pre-release
# "moe." name too; always written as "experts.{E}.*".
LEGACY_RENAMES = {
    "moe.gate_up_proj": EXPERT_GATE_UP,
    "moe.down_proj": EXPERT_DOWN,
    "moe.per_expert_scale": "router.per_expert_scale",
}

# Per-layer tensors kept bit-identical (bf16). Routers stay high precision (case P09).
LAYER_KEEP = (
    *(f"{n}.weight" for n in LAYER_NORMS + ATTENTION_NORMS),
    "router.proj.weight",
    "router.scale",
    "router.per_expert_scale",
    "layer_scalar",
)
# Kept language-model tensors outside the layers (relative to the LM prefix).
MODEL_KEEP = ("embed_tokens.weight", "norm.weight")
# Whole sub-trees kept bf16 and listed as excluded (modelopt's default disabled quantizers):
# g4.convert.gemma4.TOWER_PREFIXES.

_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_OUT_RE = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_scale_2|input_scale)")
_DENSE_MODULES = frozenset(m for g in DENSE_GROUPS for m in g.members)


def quantized_names(module: str, *, with_input_scale: bool) -> list[str]:
    """Output tensor names of one NVFP4 linear ``module``, in write order."""
    return [f"{module}.{s}" for s in (QUANT_SUFFIXES if with_input_scale else QUANT_SUFFIXES[:3])]


def expert_module(layer_prefix: str, expert: int, proj: str) -> str:
    """``…layers.{L}.experts.{E}.{proj}``: the per-expert linear vLLM loads."""
    return f"{layer_prefix}experts.{expert}.{proj}"


@dataclass(frozen=True)
class OutputName:
    """One tensor name of an NVFP4 output, parsed against the table (anchored, exact).

    ``kind``: the model part (:data:`g4.convert.gemma4.LAYER_MODULE_KINDS` labels);
    ``layer_prefix`` / ``layer`` / ``expert`` / ``proj``: where it sits (None outside a layer
    / an expert); ``module`` and ``suffix``: the name split at its last component.
    """

    name: str
    kind: str
    module: str
    suffix: str
    layer_prefix: str | None = None
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None


def parse_output_name(name: str) -> OutputName | None:
    """The table's reading of an output tensor name, or None for a name the table does not
    produce (fused or pre-release expert names, compressed-tensors names, anything else)."""
    module, _, suffix = name.rpartition(".")
    if name.startswith(TOWER_PREFIXES):
        return OutputName(name, TOWERS_KIND, module, suffix)
    if name == "lm_head.weight":
        return OutputName(name, MODEL_MODULE_KINDS["lm_head"], module, suffix)
    prefix = next((p for p in (MULTIMODAL_PREFIX, TEXT_PREFIX) if name.startswith(p)), None)
    if prefix is None:
        return None
    rel = name[len(prefix):]
    if rel in MODEL_KEEP:
        return OutputName(name, MODEL_MODULE_KINDS[rel.rpartition(".")[0]], module, suffix)
    m = _LAYER_RE.fullmatch(rel)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    where = dict(layer_prefix=f"{prefix}layers.{layer}.", layer=layer)
    e = _EXPERT_OUT_RE.fullmatch(rest)
    if e is not None:
        return OutputName(name, LAYER_MODULE_KINDS[EXPERT_GATE_UP], module, suffix, expert=int(e.group(1)),
                          proj=e.group(2), **where)
    if rest in LAYER_KEEP:
        key = rest.removesuffix(".weight")
        return OutputName(name, LAYER_MODULE_KINDS[key], module, suffix, **where)
    key, _, sfx = rest.rpartition(".")
    if key in _DENSE_MODULES and sfx in QUANT_SUFFIXES:
        return OutputName(name, LAYER_MODULE_KINDS[key], module, suffix, **where)
    return None


@dataclass
class LayerSources:
    """Source tensor names of one decoder layer, by canonical (written) suffix."""

    index: int
    tensors: dict[str, str] = field(default_factory=dict)  # canonical suffix -> source name


@dataclass
class SourceMap:
    """Every source tensor assigned to exactly one rule."""

    layers: list[LayerSources]
    model_keep: list[str]  # embed, final norm, towers: (source name == output name)
    lm_head: str | None  # an untied lm_head.weight, kept bf16


def map_sources(names: list[str], *, prefix: str, num_layers: int) -> SourceMap:
    """Assign every source tensor name to a rule of the table.

    Args:
        names: all tensor names of the checkpoint.
        prefix: language-model prefix (``model.language_model.`` or ``model.``).
        num_layers: ``num_hidden_layers`` from the config.

    Raises:
        MappingError: a tensor no rule covers, a layer index outside the config, a
            tensor given under both its current and legacy name.
    """
    layers = [LayerSources(i) for i in range(num_layers)]
    model_keep: list[str] = []
    lm_head = None
    known_layer = set(LAYER_KEEP) | {EXPERT_GATE_UP, EXPERT_DOWN} | {
        f"{m}.weight" for g in DENSE_GROUPS for m in g.members
    }
    for name in sorted(names):
        rel = name[len(prefix):] if name.startswith(prefix) else None
        m = _LAYER_RE.fullmatch(rel) if rel is not None else None
        if m:
            layer, suffix = int(m.group(1)), m.group(2)
            suffix = LEGACY_RENAMES.get(suffix, suffix)
            if suffix not in known_layer:
                raise MappingError(f"tensor {name}: no rule for layer tensor '{m.group(2)}' "
                                   "(not a known Gemma 4 decoder-layer tensor; refusing to pass it through)")
            if layer >= num_layers:
                raise MappingError(f"tensor {name}: layer {layer} but the config has {num_layers} layers")
            if suffix in layers[layer].tensors:
                raise MappingError(f"tensor {name}: layer {layer} has '{suffix}' twice (current and legacy name)")
            layers[layer].tensors[suffix] = name
        elif rel in MODEL_KEEP or name.startswith(TOWER_PREFIXES):
            model_keep.append(name)
        elif name == "lm_head.weight":
            lm_head = name
        else:
            raise MappingError(f"tensor {name}: no rule maps it (unknown Gemma 4 tensor; refusing to pass it through)")
    return SourceMap(layers, model_keep, lm_head)


def exclude_modules(*, prefix: str, num_layers: int, parts: frozenset[Part], towers: list[str]) -> list[str]:
    """modelopt-style exclusion list (``module*`` prefix wildcards), sorted.

    ``lm_head`` is always excluded (tied: not written; untied: kept bf16), routers of
    every layer, present towers, and the attention / dense MLP of every layer when the
    preset leaves them bf16 (NVIDIA/Model-Optimizer ``modelopt/torch/quantization/config.py``,
    the presets' disabled quantizers).
    """
    out = {"lm_head"} | {t.rstrip(".") + "*" for t in towers}
    for layer in range(num_layers):
        lp = f"{prefix}layers.{layer}."
        out.add(f"{lp}router*")
        if Part.ATTENTION not in parts:
            out.add(f"{lp}self_attn*")
        if Part.MLP not in parts:
            out.add(f"{lp}mlp*")
    return sorted(out)
