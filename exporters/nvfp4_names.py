"""Declarative name table: Gemma 4 source tensors -> modelopt NVFP4 checkpoint tensors.

Target names are what modelopt 0.47's ``export_hf_checkpoint`` writes for Gemma 4 and
what every vLLM from 0.19.1 to 0.33 loads unpatched (vllm-project/vllm
``vllm/model_executor/models/gemma4.py``, its ``expert_params_mapping``): per-expert 2-D linears
``…layers.{L}.experts.{E}.{gate_proj|up_proj|down_proj}.{weight|weight_scale|weight_scale_2|input_scale}``,
never ``.moe.``, never fused 3-D NVFP4 tensors.

Two tables. :func:`map_sources` assigns every tensor of a source checkpoint to one rule; a
source tensor with no rule, or a required tensor that is absent, is a :class:`MappingError`
(case P01: nothing fused may pass through unquantized by omission). :class:`Nvfp4Layout`
lists every output tensor once (name, dtype, shape, role, source), in production order, with
a lookup by name: the converter's specs and write order, the checker
(``g4.exporters.modelopt_nvfp4.check_export``), the reference loader and the model card all
read it; no output name is built or parsed anywhere else.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum

import torch

from g4.core.errors import MappingError
from g4.core.gemma4 import (
    ATTENTION_NORMS,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    LAYER_MODULE_KINDS,
    LAYER_NORMS,
    LM_HEAD,
    MODEL_MODULE_KINDS,
    TOWER_PREFIXES,
    TOWERS_KIND,
    Architecture,
    tower_of,
)
from g4.quantizers.nvfp4 import BLOCK_SIZE as NVFP4_BLOCK


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

# Per-layer tensors kept bit-identical (bf16), as (module key of LAYER_MODULE_KINDS, tensor
# suffix), in output order. Routers stay high precision (case P09).
LAYER_KEEP: tuple[tuple[str, str], ...] = (
    *((n, f"{n}.weight") for n in LAYER_NORMS + ATTENTION_NORMS),
    ("router.proj", "router.proj.weight"),
    ("router.scale", "router.scale"),
    ("router.per_expert_scale", "router.per_expert_scale"),
    ("layer_scalar", "layer_scalar"),
)
# Kept language-model tensors outside the layers (relative to the LM prefix -> MODEL_MODULE_KINDS key).
MODEL_KEEP = {"embed_tokens.weight": "embed_tokens", "norm.weight": "norm"}
# Whole sub-trees kept bf16 and listed as excluded (modelopt's default disabled quantizers):
# g4.core.gemma4.TOWER_PREFIXES.

# Source names are classified with a regex: a source checkpoint is a file of unknown origin
# (any layer count, pre-release names, stray tensors to refuse), so its names are read, not
# looked up. Output names are never parsed: they are looked up in Nvfp4Layout.by_name.
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


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
    known_layer = {suffix for _, suffix in LAYER_KEEP} | {EXPERT_GATE_UP, EXPERT_DOWN} | {
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
        elif rel in MODEL_KEEP or tower_of(name) is not None:
            model_keep.append(name)
        elif name == LM_HEAD:
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


# --------------------------------------------------------------------------- the output table


class Role(str, Enum):
    """What an output tensor is to its module. A quantized linear writes the four NVFP4 roles
    (modelopt 0.47 ``export_hf_checkpoint``; ``input_scale`` only with activation quantization),
    everything else is ``KEPT`` in its source dtype."""

    WEIGHT = "weight"  # uint8 [out, in/2]: two E2M1 codes per byte
    WEIGHT_SCALE = "weight_scale"  # float8_e4m3fn [out, in/16]: one scale per 16-input block
    WEIGHT_SCALE_2 = "weight_scale_2"  # float32 []: the global (per-tensor) scale
    INPUT_SCALE = "input_scale"  # float32 []: static activation scale (W4A4 only)
    K_SCALE = "k_scale"  # float32 []: FP8 KV cache scale of the keys, amax / 448 (--kv-cache-dtype fp8)
    V_SCALE = "v_scale"  # float32 []: FP8 KV cache scale of the values, amax / 448
    KEPT = "kept"  # stored as in the source


QUANT_ROLES = (Role.WEIGHT, Role.WEIGHT_SCALE, Role.WEIGHT_SCALE_2, Role.INPUT_SCALE)
KV_ROLES = (Role.K_SCALE, Role.V_SCALE)

# FP8 KV cache (``--kv-cache-dtype fp8``): modelopt 0.47 names the calibrated amax of an
# attention's k / v bmm quantizer ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale``
# (NVIDIA/Model-Optimizer ``modelopt/torch/export/quant_utils.py``, ``_KV_CACHE_REPLACEMENTS``),
# also on k_eq_v full-attention layers, which have no v_proj module: there V is v_norm of K's
# projection and gets its own scale under the v_proj name all the same. vLLM maps both to
# ``<attn>.attn.{k,v}_scale`` (vllm-project/vllm ``vllm/model_executor/layers/quantization/
# base_config.py``, ``get_cache_scale_mapper``); a layer without v_scale would get max(k, v) =
# k_scale for V (``kv_cache.py``, ``BaseKVCacheMethod.process_weights_after_loading``).
KV_SCALE_MODULES = {Role.K_SCALE: "self_attn.k_proj", Role.V_SCALE: "self_attn.v_proj"}
# Where the calibrator records each amax (g4.convert.calibrate.record_kv_amax), by role.
KV_AMAX_KEYS = {Role.K_SCALE: "self_attn.k_bmm", Role.V_SCALE: "self_attn.v_bmm"}
KV_CACHE_KIND = "KV cache scales"


@dataclass(frozen=True)
class Linear:
    """One NVFP4 linear of the output.

    ``module``: its output module name (tensors ``{module}.{role}``); ``key``: its module relative to
    the decoder layer, as transformers and the calibrator name it (``self_attn.q_proj``, or the fused
    ``experts.gate_up_proj`` / ``experts.down_proj`` an expert linear is cut from); ``source``: the
    source tensor it is quantized from (the fused 3-D tensor for experts); ``hf_name``: the tensor
    of transformers' model its dequantized weight goes into (``…q_proj.weight``, or the fused expert
    tensor, rows of expert ``expert``); ``group``: the modules sharing its ``weight_scale_2`` and
    ``input_scale`` (a dense q/k/v or gate/up group; an expert's gate and up).
    Shapes in elements: ``weight`` is ``[out_features, in_features]`` before packing.
    """

    module: str
    key: str
    kind: str
    layer: int
    out_features: int
    in_features: int
    source: str
    hf_name: str
    group: tuple[str, ...]
    act_quant: bool
    expert: int | None = None
    proj: str | None = None  # gate_proj / up_proj / down_proj of an expert

    @property
    def roles(self) -> tuple[Role, ...]:
        return QUANT_ROLES if self.act_quant else QUANT_ROLES[:3]

    def name(self, role: Role) -> str:
        return f"{self.module}.{role.value}"

    @property
    def names(self) -> list[str]:
        """Its output tensor names, in write order."""
        return [self.name(r) for r in self.roles]

    @property
    def input_key(self) -> str:
        """Where transformers' model applies its input scale: the linear module, or for an expert
        the fused expert tensor (all experts of a layer share one input scale per projection)."""
        return self.module if self.expert is None else self.hf_name

    def shapes(self) -> dict[Role, tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of each role (modelopt 0.47's NVFP4 export, block size 16)."""
        o, i = self.out_features, self.in_features
        return {Role.WEIGHT: (torch.uint8, (o, i // 2)),
                Role.WEIGHT_SCALE: (torch.float8_e4m3fn, (o, i // NVFP4_BLOCK)),
                Role.WEIGHT_SCALE_2: (torch.float32, ()), Role.INPUT_SCALE: (torch.float32, ())}


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of an NVFP4 output: name, dtype, shape, role and what it comes from.

    ``kind``: the model part (:data:`g4.core.gemma4.LAYER_MODULE_KINDS` labels, the model
    card's rows); ``source``: the source tensor it is written from; ``module``: the module the
    exclusion list is matched against; ``linear``: its NVFP4 linear (None when kept);
    ``excludable``: a kept tensor that ``exclude_modules`` must cover (2-D linear weights kept in
    the source dtype, and everything under a tower).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    role: Role
    kind: str
    source: str
    module: str
    layer: int | None = None
    linear: Linear | None = None
    excludable: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class LayerLayout:
    """The outputs of one decoder layer in production order: ``kept`` tensors, then the dense
    ``groups`` (each quantized with one shared ``weight_scale_2``), then per expert its
    ``(gate_proj, up_proj, down_proj)``, then (FP8 KV cache only) its ``kv_scales``
    (``k_scale``, ``v_scale``). ``sources``: canonical suffix -> source tensor name."""

    index: int
    prefix: str
    sources: dict[str, str]
    kept: tuple[OutputTensor, ...]
    groups: tuple[tuple[Linear, ...], ...]
    experts: tuple[tuple[Linear, Linear, Linear], ...]
    kv_scales: tuple[OutputTensor, ...] = ()

    @property
    def linears(self) -> list[Linear]:
        return [lin for g in self.groups for lin in g] + [lin for e in self.experts for lin in e]


@dataclass(frozen=True)
class Nvfp4Layout:
    """Every tensor of an NVFP4 output, listed once, in the order the converter writes it.

    Built from the model's :class:`~g4.core.gemma4.Architecture`, the language-model
    ``prefix``, the quantized ``parts``, ``act_quant`` (W4A4: an ``input_scale`` per
    linear) and ``kv_cache`` (FP8 KV cache: a float32 ``[]`` ``k_scale`` and ``v_scale`` per
    decoder layer, :data:`KV_SCALE_MODULES`), with the source's tensor dtypes and towers:
    :meth:`from_source` at conversion, :meth:`from_output` for a finished OUT. ``tensors`` in
    production order, ``by_name`` the lookup, ``layers`` the per-layer view the writer walks,
    ``model`` the kept tensors outside the layers (embedding, final norm, towers, an untied
    lm_head), written last.
    """

    arch: Architecture
    prefix: str
    parts: frozenset[Part]
    act_quant: bool
    towers: tuple[str, ...]  # tower prefixes present (TOWER_PREFIXES order)
    layers: tuple[LayerLayout, ...]
    model: tuple[OutputTensor, ...]
    kv_cache: bool = False
    tensors: tuple[OutputTensor, ...] = field(init=False)
    by_name: dict[str, OutputTensor] = field(init=False)

    def __post_init__(self):
        order: list[OutputTensor] = []
        for lay in self.layers:
            order += lay.kept
            for lin in lay.linears:
                dtypes = lin.shapes()
                order += [OutputTensor(lin.name(r), *dtypes[r], r, lin.kind, lin.source, lin.module, lin.layer, lin)
                          for r in lin.roles]
            order += lay.kv_scales
        order += self.model
        by_name = {t.name: t for t in order}
        if len(by_name) != len(order):
            raise ValueError("NVFP4 layout lists a tensor twice")  # internal invariant
        object.__setattr__(self, "tensors", tuple(order))
        object.__setattr__(self, "by_name", by_name)

    @property
    def linears(self) -> list[Linear]:
        return [lin for lay in self.layers for lin in lay.linears]

    def exclude_modules(self) -> list[str]:
        """The exclusion list of this output (:func:`exclude_modules`)."""
        return exclude_modules(prefix=self.prefix, num_layers=self.arch.num_layers, parts=self.parts,
                               towers=list(self.towers))

    @classmethod
    def build(cls, arch: Architecture, *, prefix: str, parts: frozenset[Part], act_quant: bool,
              layer_sources: list[dict[str, str]], model_sources: list[str], lm_head: str | None,
              dtypes: dict[str, torch.dtype], shapes: dict[str, tuple[int, ...]],
              kv_cache: bool = False) -> "Nvfp4Layout":
        """The table of one output.

        Args:
            arch: the model.
            prefix: language-model key prefix (``model.language_model.`` or ``model.``).
            parts: quantized parts (:data:`PRESETS`); the experts always are.
            act_quant: W4A4 (an ``input_scale`` per linear) or W4A16.
            layer_sources: per layer, canonical suffix -> source tensor name (:class:`SourceMap`).
            model_sources: kept tensors outside the layers (embedding, final norm, towers), written
                under their source names.
            lm_head: an untied ``lm_head.weight``'s source name, or None.
            dtypes / shapes: of the kept tensors, by source name (as stored in the source).
            kv_cache: FP8 KV cache scales (``k_scale``, ``v_scale``) for every decoder layer.
        """
        layers = []
        for L, src in enumerate(layer_sources):
            lp = f"{prefix}layers.{L}."
            want = arch.layer_tensor_shapes(L)

            def kept(key: str, suffix: str, excludable: bool = False) -> OutputTensor:
                s = src[suffix]
                name = lp + suffix  # its module: the name without its last component, as modelopt matches
                return OutputTensor(name, dtypes[s], shapes[s], Role.KEPT, LAYER_MODULE_KINDS[key], s,
                                    name.rpartition(".")[0], L, excludable=excludable)

            keep = [kept(key, suffix, excludable=key == "router.proj") for key, suffix in LAYER_KEEP]
            groups = []
            for g in DENSE_GROUPS:
                members = [m for m in g.members if f"{m}.weight" in src]
                if g.part not in parts:
                    keep += [kept(m, f"{m}.weight", excludable=True) for m in members]
                    continue
                group = tuple(lp + m for m in members)
                groups.append(tuple(
                    Linear(lp + m, m, LAYER_MODULE_KINDS[m], L, *want[f"{m}.weight"], src[f"{m}.weight"],
                           lp + f"{m}.weight", group, act_quant) for m in members))
            inter, hidden = arch.moe_intermediate, arch.hidden
            experts = []
            for e in range(arch.experts):
                mod = {proj: f"{lp}experts.{e}.{proj}" for proj in EXPERT_PROJS}
                pair = (mod["gate_proj"], mod["up_proj"])
                experts.append(tuple(
                    Linear(mod[proj], fused, LAYER_MODULE_KINDS[fused], L, out_f, in_f, src[fused], lp + fused,
                           pair if proj != "down_proj" else (mod[proj],), act_quant, expert=e, proj=proj)
                    for proj, fused, out_f, in_f in (("gate_proj", EXPERT_GATE_UP, inter, hidden),
                                                     ("up_proj", EXPERT_GATE_UP, inter, hidden),
                                                     ("down_proj", EXPERT_DOWN, hidden, inter))))
            kv = tuple(OutputTensor(f"{lp}{KV_SCALE_MODULES[r]}.{r.value}", torch.float32, (), r, KV_CACHE_KIND,
                                    src["self_attn.k_proj.weight"], lp + KV_SCALE_MODULES[r], L)
                       for r in KV_ROLES) if kv_cache else ()
            layers.append(LayerLayout(L, lp, dict(src), tuple(keep), tuple(groups), tuple(experts), kv))
        lm = {prefix + rel: key for rel, key in MODEL_KEEP.items()}
        towers = tuple(t for t in TOWER_PREFIXES if any(tower_of(n) == t for n in model_sources))
        model = []
        for name in model_sources:
            if name in lm:
                kind, excludable = MODEL_MODULE_KINDS[lm[name]], False
            else:  # under a tower (map_sources admitted nothing else)
                kind, excludable = TOWERS_KIND, True
            model.append(OutputTensor(name, dtypes[name], shapes[name], Role.KEPT, kind, name, name.rpartition(".")[0],
                                      excludable=excludable))
        if lm_head is not None:
            model.append(OutputTensor(LM_HEAD, dtypes[lm_head], shapes[lm_head], Role.KEPT,
                                      MODEL_MODULE_KINDS["lm_head"], lm_head, "lm_head", excludable=True))
        return cls(arch, prefix, frozenset(parts) | {Part.EXPERTS}, act_quant, towers, tuple(layers), tuple(model),
                   kv_cache)
