"""Gemma 4 MoE (``gemma-4-26B-A4B`` and the embedded tiny model) as a neuronx-distributed-inference
(NxDI) 0.8 model class: ``NeuronGemma4MoEForCausalLM`` over ``NeuronGemma4MoEModel`` and
``NeuronGemma4MoEDecoderLayer``, configured by ``Gemma4MoEInferenceConfig``.

Built the way NxDI's own MoE classes are (aws-neuron/neuronx-distributed-inference, Neuron SDK
2.28.0 release, ``src/neuronx_distributed_inference/models/qwen3_moe/modeling_qwen3_moe.py`` and
``models/mixtral/modeling_mixtral.py``): a ``NeuronBaseModel`` whose ``setup_attr_for_model`` /
``init_model`` declare ``embed_tokens``, ``layers``, ``norm`` and ``lm_head``, driven by
``NeuronBaseForCausalLM`` (context encoding, token generation, the KV cache manager, sampling).
The Gemma 4 semantics are those of transformers 5.24 ``models/gemma4/modeling_gemma4.py``
(``Gemma4TextDecoderLayer``, ``Gemma4TextAttention``, ``Gemma4TextRouter``,
``Gemma4TextExperts``, ``Gemma4TextScaledWordEmbedding``, ``Gemma4TextRotaryEmbedding``) and
``modeling_rope_utils.py`` (``_compute_proportional_rope_parameters``):

- embedding ``E[ids] * sqrt(H)``, the scale cast to the weight dtype first (53.0 in bf16 for H=2816);
- per layer type its own head_dim and KV heads (sliding: ``head_dim`` / ``num_key_value_heads``;
  full: ``global_head_dim`` / ``num_global_key_value_heads``); the KV cache is allocated per layer
  with those shapes (``Gemma4KVCacheManager``), ``max_length`` positions on a full layer and a ring
  of ``sliding_window - 1`` on a sliding one (:func:`g4.core.gemma4.kv_cache_positions`; 1023 of the
  26B's 1024-token window instead of every position);
- full layers with ``attention_k_eq_v`` have no ``v_proj``: V is the raw ``k_proj`` output, then the
  weightless v_norm (K gets k_norm and RoPE);
- q_norm / k_norm with weights, v_norm without; RMSNorm multiplies by the weight itself (no ``1 + w``);
- attention scale 1.0 (no ``1/sqrt(d)``: q_norm and k_norm absorb it);
- RoPE: ``default`` on sliding layers, ``proportional`` on full layers, computed as transformers
  does: ``inv_freq = theta^(-2i/head_dim)`` for ``i < int(partial_rotary_factor * head_dim // 2)``
  and 0 for the rest, applied with ``rotate_half`` over the whole head_dim (so with head_dim 512 and
  factor 0.25 the rotated dims are [0:64] and [256:320], not "the first 128");
- sliding-window attention (``q - k < sliding_window``) on sliding layers: in context encoding a
  windowed causal mask over the prompt, whose last ``sliding_window - 1`` K/V NxDI's
  ``get_last_kv_window`` lays out in the ring; in token generation the ring's filled slots (every
  position they hold is inside the window) plus the new token, written at ``position % ring`` by
  NxDI's KV cache manager;
- the dense MLP beside the experts (``gelu_pytorch_tanh`` GeGLU) and its own norms;
- the router on the raw residual: weightless RMSNorm, ``* scale * H^-0.5``, ``proj``, fp32 softmax,
  top-k, renormalise, ``* per_expert_scale``; the experts on ``pre_feedforward_layernorm_2(x)``
  through NxD's ``ExpertMLPsV2`` (aws-neuron/neuronx-distributed v2.28.0
  ``src/neuronx_distributed/modules/moe/expert_mlps_v2.py``), which in token generation with
  ``T * top_k / E < 1`` takes ``forward_selective_loading`` (only the chosen experts' weights);
- ``layer_scalar`` multiplies the whole residual stream at the end of each layer;
- final norm, tied (or untied) lm_head, ``softcap * tanh(logits / softcap)``.

Weights: unquantized (fp32 or bf16) from a Hugging Face Gemma 4 checkpoint (multimodal release
layout or text-only; the vision tower is dropped), or, with ``NeuronConfig(quantized=True)``, a
``g4convert int8-neuron --tp T`` result at ``tp_degree`` T: its per-rank files are this class's
``state_dict()`` at TP T (g4's layout table, ``g4.exporters.neuron_int8``), and each rank loads only
its own file, as NxDI's Route 2 does with pre-sharded checkpoints
(:meth:`NeuronGemma4MoEForCausalLM.to_cpu` on the CPU, :meth:`~NeuronGemma4MoEForCausalLM.load_weights`
on Neuron, :func:`load_g4_int8_neuron`, :func:`convert_to_g4_int8`). Attention heads, the dense MLP and
the experts' intermediate dimension are split over TP; a layer with fewer KV heads than ranks gets its KV heads
replicated (rank r holds head ``r * kv_heads // tp``), as NxDI's GQA ``REPLICATE_TO_TP_DEGREE``
does. This module imports NxD and NxDI at the top:
import it only where they are installed (a Neuron host, or the CPU test lane
``tests/lanes/test_nxdi_gemma4.py``).

Known mistakes of the unmerged NxDI Gemma 4 pull requests that this class does not repeat
(aws-neuron/neuronx-distributed-inference #172 ``contrib/models/gemma-4-26b-a4b-it``, #106
``contrib/models/gemma-4-31b-it``): #172 applies RoPE to the first 128 dims of a full layer (HF
rotates [0:64] and [256:320] of 512) and aliases ``gelu_pytorch_tanh`` to exact gelu for the
experts; here both follow transformers.

Defects of NxDI 0.8 met here, and how this module avoids them (NxDI itself is not patched):

- ``models/model_base.py:3827,3831`` (``NeuronBaseForCausalLM._copy_past_key_values``, reached only
  when the model runs on the CPU) calls ``self._get_captured_tensors_offset()``, which 0.8 defines
  only on ``models/image_to_text_model_base.py:631``: ``NeuronGemma4MoEForCausalLM`` defines it the
  same way (the tensor-capture offset, 0 without tensor capture).
- (a Neuron run meets this one too) ``utils/hf_adapter.py:313`` (``HuggingFaceGenerationAdapter.prepare_inputs_for_generation``) uses
  the undefined name ``tensor_capture_hook`` and ``NeuronBaseForCausalLM.forward``
  (``models/model_base.py:3355``) has no such parameter: :func:`greedy_generate` drives
  ``NeuronBaseForCausalLM.forward`` itself instead of the adapter.
- (Neuron too) NxD ``modules/moe/model_utils.py:11-18`` ``ACT2FN`` has no ``gelu_pytorch_tanh``: the experts are
  built with ``hidden_act="gelu"`` and this instance's ``Experts._activation_fn`` is then set to the
  tanh approximation (``F.gelu(x, approximate="tanh")``, what transformers' ``gelu_pytorch_tanh``
  is); NxD's module is not changed.
- NxDI 0.8's ``to_cpu`` (``models/application_base.py:597-608``) always re-shards the checkpoint with
  NxD's ``get_sharded_checkpoint``, which a pre-sharded rank file must not go through:
  :meth:`NeuronGemma4MoEForCausalLM.to_cpu` takes NxDI's CPU steps itself for a g4 int8-neuron result.
- NxD ``parallel_layers/layers.py:145,150`` (``_initialize_parameter_cpu``) breaks a
  CPU-device build of quantized row and expert-column layers at TP > 1: :func:`convert_to_g4_int8`
  builds them in NxD's AOT mode.
- (Neuron too) NxD's expert-wise q_config defaults to float8_e4m3
  (``quantization/quantization_config.py``: ``get_default_expert_wise_per_channel_custom_qconfig_dict``);
  int8 weights loaded into it are silently rounded to float8 (measured: logits off by 2e-2 on the
  embedded model): :func:`convert_to_g4_int8` sets ``quantized_dtype`` to int8.
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import List, Optional

import torch
import torch.nn.functional as F
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
from neuronx_distributed.modules.moe.moe_configs import RoutedExpertsMLPOpsConfig
from neuronx_distributed.parallel_layers import mappings, parallel_state
from neuronx_distributed.parallel_layers.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
)
from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel
from neuronx_distributed_inference.modules.attention.utils import get_last_kv_window
from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager, get_kv_shapes
from torch import nn

from g4.core.checkpoint import CONFIG_NAME
from g4.core.errors import CheckpointError, G4Error
from g4.core.gemma4 import (
    ATTENTION_CONFIG_KEYS,
    LAYER_NORMS,
    LM_HEAD,
    AttentionLayer,
    attention_layers,
    embed_scale,
    is_tied,
    kv_cache_layers,
    kv_cache_positions,
    kv_heads_per_rank,
    layer_types,
    read_architecture,
)
from g4.exporters.neuron_int8 import (
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    KV_HEADS,
    MANIFEST,
    Manifest,
    entry_of,
    is_rank_index,
    layer_entries,
    layer_prefix,
    model_entries,
)
from g4.serve.neuron_runtime import load_rank_weights

SLIDING, FULL = "sliding_attention", "full_attention"


# ------------------------------------------------------------------------------------------ config
class Gemma4MoEInferenceConfig(InferenceConfig):
    """The text config of a Gemma 4 MoE checkpoint, flattened for NxDI (``text_config`` of the
    multimodal release layout, or the top level of a text-only one). Release keys
    (``global_head_dim``, ``num_global_key_value_heads``) are read; ``num_local_experts``,
    ``num_experts_per_tok``, ``hidden_act`` and ``intermediate_size`` are set the way NxDI's
    ``initialize_moe_module`` / ``ExpertMLPsV2`` name them (the dense MLP width stays in
    ``dense_intermediate_size``).

    Every Gemma 4 fact comes from g4's one reader, :mod:`g4.core.gemma4` (what the converter, the
    rank-file layout, the memory plan and the CPU reference read): the layer types, each layer's
    head dim, KV heads and ``v_proj`` (:meth:`attention_of`, with transformers' defaults for keys a
    config leaves out: ``global_head_dim`` 512, ``num_global_key_value_heads`` only with
    ``attention_k_eq_v``), the tie, the decoder norms and the embedding scale."""

    def add_derived_config(self):
        super().add_derived_config()
        self.num_local_experts = self.num_experts
        self.num_experts_per_tok = self.top_k_experts
        self.n_shared_experts = 0
        self.hidden_act = self.hidden_activation
        if not hasattr(self, "dense_intermediate_size"):
            self.dense_intermediate_size = self.intermediate_size
            self.intermediate_size = self.moe_intermediate_size
        self.neuron_config.router_config.dtype = torch.float32
        self.neuron_config.router_config.act_fn = "softmax"
        # Gemma 4's router renormalises and applies per_expert_scale itself (Gemma4TextRouter);
        # ExpertMLPsV2 must take the affinities as given.
        self.neuron_config.normalize_top_k_affinities = False

    def get_required_attributes(self) -> List[str]:
        return ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "layer_types", "rope_parameters", "sliding_window", "rms_norm_eps", "vocab_size", "num_experts",
                "top_k_experts", "moe_intermediate_size", "hidden_activation", "final_logit_softcapping",
                "attention_k_eq_v", "tie_word_embeddings"]

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig

    def attention_of(self, layer: int) -> AttentionLayer:
        """Layer ``layer``'s attention shape (:func:`g4.core.gemma4.attention_layers` of this config)."""
        return attention_layers({k: getattr(self, k, None) for k in ATTENTION_CONFIG_KEYS})[layer]

    def head_dim_of(self, layer: int) -> int:
        return self.attention_of(layer).head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.attention_of(layer).kv_heads

    def cache_positions(self) -> tuple[int, ...]:
        """Positions of each layer's KV cache (:func:`g4.core.gemma4.kv_cache_positions`: a full
        layer ``max_length``, a sliding layer a ring of ``min(sliding_window - 1, max_length)``)."""
        layers = attention_layers({k: getattr(self, k, None) for k in ATTENTION_CONFIG_KEYS})
        return kv_cache_positions(layers, self.neuron_config.max_length, self.sliding_window)


def load_gemma4_config(model_path: str):
    """A ``load_config`` callable for :class:`Gemma4MoEInferenceConfig` (NxDI's
    ``load_pretrained_config`` goes through transformers' AutoConfig, and the transformers that
    NxDI 0.8 pins, 4.57, has no Gemma 4): reads ``config.json`` itself."""

    def load(config: InferenceConfig) -> None:
        with open(os.path.join(model_path, CONFIG_NAME)) as f:
            raw = json.load(f)
        text = raw.get("text_config") or raw
        if "per_layer_config" in text:
            raise ValueError(f"{model_path}/config.json has a per_layer_config (transformers >= 5.15 re-save); "
                             "write it back in the release form (global_head_dim, num_global_key_value_heads)")
        try:
            arch = read_architecture(raw)
        except G4Error as e:
            raise ValueError(f"{model_path}/config.json: {e}") from e
        for key, value in text.items():
            setattr(config, key, value)
        # what g4's reader derives where the config leaves a key out (transformers' defaults)
        config.layer_types = layer_types(text)
        config.attention_k_eq_v = arch.k_eq_v
        config.tie_word_embeddings = is_tied(raw)
        config.pad_token_id = text.get("pad_token_id", 0)
        config._name_or_path = model_path
        # what transformers' PretrainedConfig would carry; NxDI's forward reads them
        # (models/model_base.py: NeuronBaseForCausalLM._setup_func_config)
        config.output_attentions = False
        config.output_hidden_states = False
        config.use_return_dict = True

    return load


# ------------------------------------------------------------------------------------------ pieces
class Gemma4RMSNorm(nn.Module):
    """``x * (mean(x^2) + eps)^-0.5``, times ``weight`` (not ``1 + weight``) when it has one; fp32
    inside, cast back (transformers' ``Gemma4RMSNorm``). The weight is held in ``dtype`` (the
    model's ``torch_dtype``, as every other weight of the class and of the rank files)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.type_as(x)


def gemma4_inv_freq(config: Gemma4MoEInferenceConfig, layer_type: str) -> torch.Tensor:
    """RoPE inverse frequencies of one layer type, as transformers 5.24 computes them
    (``Gemma4TextRotaryEmbedding.compute_default_rope_parameters`` for ``default``,
    ``modeling_rope_utils._compute_proportional_rope_parameters`` for ``proportional``)."""
    params = config.rope_parameters[layer_type]
    dim = next(config.head_dim_of(i) for i, t in enumerate(config.layer_types) if t == layer_type)
    base = params["rope_theta"]
    kind = params.get("rope_type", "default")
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind != "proportional":
        raise NotImplementedError(f"rope_type {kind!r} on {layer_type} layers")
    angles = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
    inv_freq = torch.cat([rotated, torch.zeros(dim // 2 - angles, dtype=torch.float32)])
    return inv_freq / params.get("factor", 1.0)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Gemma4ScaledEmbedding(ParallelEmbedding):
    """NxD's ``ParallelEmbedding`` times ``sqrt(hidden_size)`` cast to the weight dtype
    (``Gemma4TextScaledWordEmbedding``); the stored table stays unscaled, so a tied lm_head reads
    it as is. State-dict key ``embed_tokens.weight``."""

    def __init__(self, *args, embed_scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.embed_scale = embed_scale

    def forward(self, input_ids):
        out = super().forward(input_ids)
        return out * torch.tensor(self.embed_scale, dtype=self.weight.dtype)


class Gemma4SoftcappedLMHead(ColumnParallelLinear):
    """NxD's ``ColumnParallelLinear`` followed by ``softcap * tanh(x / softcap)`` in fp32 (an
    elementwise op, so it commutes with the vocabulary split). Key ``lm_head.weight``."""

    def __init__(self, *args, softcap: Optional[float], **kwargs):
        super().__init__(*args, **kwargs)
        self.softcap = softcap

    def forward(self, x, *args, **kwargs):
        logits = super().forward(x, *args, **kwargs)
        if not self.softcap:
            return logits
        return (torch.tanh(logits.float() / self.softcap) * self.softcap).to(logits.dtype)


class Gemma4KVCacheManager(KVCacheManager):
    """NxDI's ``KVCacheManager`` with one K and one V buffer shape per layer: that layer's KV heads
    per rank and head_dim (sliding 8 x 256, full 2 x 512 on the 26B), from
    :func:`g4.core.gemma4.kv_cache_layers`, and its positions from ``layer_to_cache_size_mapping``
    (:func:`g4.core.gemma4.kv_cache_positions`: ``sliding_window - 1`` on a sliding layer), the
    functions the memory plan sizes the cache with (``g4.convert.plan.kv_cache_nxdi``). NxDI 0.8
    allocates per-layer shapes when ``layer_to_cache_size_mapping`` is given
    (``modules/kvcache/kv_cache_manager.py``, ``__init__`` / ``_init_kv_shape``); only the head
    geometry is Gemma 4's. Reads and writes are NxDI's own."""

    def _init_kv_shape(self, config, layer_to_cache_size_mapping=None):
        tp = config.neuron_config.tp_degree
        batch = config.neuron_config.kv_cache_batch_size + config.neuron_config.kv_cache_padding_size
        layers = kv_cache_layers(attention_layers({k: getattr(config, k, None) for k in ATTENTION_CONFIG_KEYS}), tp)
        self.padded_layer_ids = []
        self.k_shapes, self.v_shapes = [], []
        for layer, cache_len in zip(layers, layer_to_cache_size_mapping, strict=True):
            k_shape, v_shape = get_kv_shapes(cache_len, batch, layer.heads, layer.head_dim,
                                             self.k_cache_transposed, self.is_kv_cache_tiled)
            self.k_shapes.append(k_shape)
            self.v_shapes.append(v_shape)


def _kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads each rank holds: :func:`g4.core.gemma4.kv_heads_per_rank` (fewer KV heads than
    ranks are replicated whole, as NxDI's GQA ``REPLICATE_TO_TP_DEGREE`` does, ``modules/attention/gqa.py``:
    the 26B's 2 full-attention KV heads at TP 4, the embedded model's 1 at TP 2)."""
    return kv_heads_per_rank(kv_heads, tp)


def replicate_kv_rows(weight: torch.Tensor, kv_heads: int, head_dim: int, tp: int) -> torch.Tensor:
    """``k_proj`` / ``v_proj`` weight ``[kv_heads * d, H]`` with each head's rows repeated
    ``tp / kv_heads`` times when there are fewer KV heads than ranks, so that the column split gives
    rank r head ``r * kv_heads // tp``; unchanged otherwise."""
    if kv_heads >= tp:
        return weight
    rows = weight.view(kv_heads, head_dim, -1)
    return rows.repeat_interleave(tp // kv_heads, dim=0).reshape(tp * head_dim, -1).contiguous()


# --------------------------------------------------------------------------------------- attention
class NeuronGemma4Attention(nn.Module):
    """One Gemma 4 attention layer over NxD's column / row parallel linears (heads split over TP).
    Context encoding: causal (and, on sliding layers, windowed) attention over the prompt; token
    generation: the cached K/V (NxDI's KV cache manager hands them in as ``past_key_value``) plus
    the new token, as NxDI's ``NeuronAttentionBase.compute_for_token_gen`` decomposes it
    (``modules/attention/attention_base.py``). Returns the new K and V ``[B, kv_heads/T, S, d]`` for
    the cache manager to store."""

    def __init__(self, config: Gemma4MoEInferenceConfig, layer_idx: int):
        super().__init__()
        tp = config.neuron_config.tp_degree
        dtype = config.neuron_config.torch_dtype
        self.layer_type = config.layer_types[layer_idx]
        self.is_sliding = self.layer_type == SLIDING
        self.sliding_window = config.sliding_window if self.is_sliding else None
        # a sliding layer's cache is a ring of this many positions (Gemma4KVCacheManager)
        self.cache_positions = config.cache_positions()[layer_idx]
        self.head_dim = config.head_dim_of(layer_idx)
        if config.num_attention_heads % tp:
            raise NotImplementedError(f"{config.num_attention_heads} query heads over TP {tp}")
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = _kv_heads_per_rank(config.kv_heads_of(layer_idx), tp)
        self.k_eq_v = not config.attention_of(layer_idx).has_v  # full layers with attention_k_eq_v
        self.scaling = 1.0  # Gemma4TextAttention.scaling: q_norm / k_norm absorb 1/sqrt(d)
        H, d = config.hidden_size, self.head_dim
        col = partial(ColumnParallelLinear, bias=False, gather_output=False, dtype=dtype)
        self.q_proj = col(H, config.num_attention_heads * d)
        kv_total = self.num_kv_heads * tp  # replicated up to tp when there are fewer KV heads than ranks
        self.k_proj = col(H, kv_total * d)
        self.v_proj = None if self.k_eq_v else col(H, kv_total * d)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, H, bias=False, input_is_parallel=True,
                                        dtype=dtype)
        self.q_norm = Gemma4RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.k_norm = Gemma4RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.v_norm = Gemma4RMSNorm(d, config.rms_norm_eps, with_scale=False)
        self.register_buffer("inv_freq", gemma4_inv_freq(config, self.layer_type), persistent=False)

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, S, h, d]``; cos/sin in fp32 then cast to x's dtype, as transformers does."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, :, None, :], emb.sin().to(x.dtype)[:, :, None, :]
        return x * cos + _rotate_half(x) * sin

    def _ring(self, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor):
        """Context encoding's K and V ``[B, kv_heads, S, d]`` as a sliding layer's cache holds them:
        the last ``cache_positions`` positions of the prompt, position p in slot
        ``p % cache_positions``, by NxDI's own ``get_last_kv_window``
        (``modules/attention/utils.py:676``, what its windowed attention hands the KV cache manager;
        it reads the last position as ``max(position_ids)``, right padding's positions being 1). A
        prompt bucket shorter than the ring is zero-padded to it first (the gather reads that many
        positions); the unwritten slots are masked in token generation."""
        n = self.cache_positions
        if k.shape[2] < n:
            k, v = (F.pad(x, (0, 0, 0, n - x.shape[2])) for x in (k, v))
        return get_last_kv_window(n + 1, position_ids, k, v)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        B, S, _ = hidden_states.shape
        shape = (B, S, -1, self.head_dim)
        q = self._rope(self.q_norm(self.q_proj(hidden_states).view(shape)), position_ids).transpose(1, 2)
        k_raw = self.k_proj(hidden_states).view(shape)
        v_raw = k_raw if self.v_proj is None else self.v_proj(hidden_states).view(shape)
        k = self._rope(self.k_norm(k_raw), position_ids).transpose(1, 2)
        v = self.v_norm(v_raw).transpose(1, 2)
        groups = self.num_heads // self.num_kv_heads
        min_value = torch.finfo(torch.float32).min

        if past_key_value is None:  # context encoding: attention over the (padded) prompt
            # NxDI's causal mask is [n_positions, n_positions] (models/model_base.py:209,
            # _create_context_attn_mask). On Neuron each context-encoding bucket is its own graph
            # with n_positions = S, so this takes it whole; NxDI's CPU mode builds one model for
            # both graphs (models/application_base.py:621) with n_positions = seq_len while the
            # prompt is padded to max_context_length, and the prompt's rows and columns come first
            mask = attention_mask[..., :S, :S].to(torch.bool)
            if self.sliding_window is not None:
                # rows and columns are prompt positions 0..S-1 (right padding; padded rows are discarded)
                pos = torch.arange(S, device=q.device)
                mask = mask & ((pos[:, None] - pos[None, :]) < self.sliding_window)
            kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            scores = (torch.matmul(q, kk.transpose(2, 3)) * self.scaling).float()
            scores = torch.where(mask, scores, min_value)
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out = torch.matmul(probs, vv)
            if self.sliding_window is not None:
                k, v = self._ring(k, v, position_ids)
        else:  # token generation: cached positions plus the active token
            k_prior, v_prior = past_key_value
            if self.sliding_window is None:
                mask = attention_mask.to(torch.bool)  # [B, 1, 1, n_positions], True where cached
            else:
                # the ring's slots: all filled once the position reaches its length, and every
                # position it holds then lies within the window (p - k <= cache_positions < window)
                slots = torch.arange(k_prior.shape[2], device=q.device)
                mask = slots[None, None, None, :] < position_ids[:, None, :, None]
            kp, vp = k_prior.repeat_interleave(groups, 1), v_prior.repeat_interleave(groups, 1)
            prior = (torch.matmul(q, kp.transpose(2, 3)) * self.scaling).float()
            prior = torch.where(mask, prior, min_value)
            active = (torch.matmul(q, k.repeat_interleave(groups, 1).transpose(2, 3)) * self.scaling).float()
            probs = torch.softmax(torch.cat([prior, active], dim=-1), dim=-1).to(q.dtype)
            n = prior.shape[-1]
            out = torch.matmul(probs[..., :n], vp) + torch.matmul(probs[..., n:], v.repeat_interleave(groups, 1))
        out = out.transpose(1, 2).reshape(B, S, -1)
        return self.o_proj(out), (k, v)


# ------------------------------------------------------------------------------------------- MoE
class NeuronGemma4Router(nn.Module):
    """``Gemma4TextRouter``: weightless RMSNorm of the residual, ``* scale * H^-0.5``, ``proj``,
    fp32 softmax, top-k, renormalise, ``* per_expert_scale``. Replicated on every rank. Returns the
    dense ``[T, E]`` affinities (zero off the top-k) and the top-k indices, what NxD's
    ``ExpertMLPsV2.forward`` takes."""

    def __init__(self, config: Gemma4MoEInferenceConfig):
        super().__init__()
        H, E = config.hidden_size, config.num_experts
        self.top_k = config.top_k_experts
        self.root = H ** -0.5
        self.norm = Gemma4RMSNorm(H, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(H, E, bias=False, dtype=config.neuron_config.torch_dtype)
        self.scale = nn.Parameter(torch.ones(H, dtype=config.neuron_config.torch_dtype))
        self.per_expert_scale = nn.Parameter(torch.ones(E, dtype=config.neuron_config.torch_dtype))

    def forward(self, x: torch.Tensor):
        # scale in the activation dtype, as transformers computes it: NxDI's load_module
        # (models/model_wrapper.py:1472-1474) keeps every parameter named ``*scale`` in fp32, which
        # would otherwise lift h to fp32 in front of the bf16 proj (a dtype error when traced in bf16)
        h = self.norm(x) * self.scale.to(x.dtype) * self.root
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.per_expert_scale[index]
        affinities = torch.zeros_like(probs).scatter(1, index, weights)
        return affinities, index


def build_expert_mlps(config: Gemma4MoEInferenceConfig) -> ExpertMLPsV2:
    """NxD's ``ExpertMLPsV2`` with the arguments NxDI's ``modules/moe_v2.py:initialize_moe_module``
    passes, fused gate_up ``[E, H, 2I]`` (gate columns first) and down ``[E, I, H]``, split over TP
    on I; then this instance's activation set to gelu-tanh (see the module docstring)."""
    nc = config.neuron_config
    experts = ExpertMLPsV2(
        routed_experts_mlp_config=RoutedExpertsMLPOpsConfig(
            num_experts=config.num_experts, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, top_k=config.top_k_experts,
            hidden_act="gelu", bias=False, glu_mlp=True, glu_type=nc.glu_type,
            hidden_act_scaling_factor=nc.hidden_act_scaling_factor, hidden_act_bias=nc.hidden_act_bias,
            early_expert_affinity_modulation=False, normalize_top_k_affinities=False,
            enable_spmd_rank=nc.blockwise_matmul_config.parallelize_token_to_block_mapping),
        blockwise_matmul_config=nc.blockwise_matmul_config,
        sequence_parallel_enabled=False,
        dtype=nc.torch_dtype,
        is_prefill=nc.is_prefill_stage,
        tensor_model_parallel_group=parallel_state.get_tensor_model_parallel_group(),
        expert_model_parallel_group=parallel_state.get_expert_model_parallel_group(),
        cte_tensor_model_parallel_group=parallel_state.get_tensor_model_parallel_group(),
        cte_expert_model_parallel_group=parallel_state.get_expert_model_parallel_group(),
        tkg_tensor_model_parallel_group=parallel_state.get_tensor_model_parallel_group(),
        tkg_expert_model_parallel_group=parallel_state.get_expert_model_parallel_group(),
    )
    experts.mlp_op._activation_fn = partial(F.gelu, approximate="tanh")
    experts.eval()
    return experts


class NeuronGemma4MoE(nn.Module):
    """Router on the raw residual, experts on ``pre_feedforward_layernorm_2(residual)`` (NxD's
    ``MoE.forward`` would feed both the same tensor), per-rank partial sums all-reduced over TP."""

    def __init__(self, config: Gemma4MoEInferenceConfig):
        super().__init__()
        self.router = NeuronGemma4Router(config)
        self.expert_mlps = build_expert_mlps(config)

    def forward(self, residual: torch.Tensor, expert_input: torch.Tensor) -> torch.Tensor:
        B, S, H = residual.shape
        affinities, index = self.router(residual.reshape(-1, H))
        out = self.expert_mlps(expert_input.reshape(-1, H), affinities.to(expert_input.dtype), index, seq_len=S)
        if parallel_state.get_tensor_model_parallel_size() > 1:
            out = mappings.reduce_from_tensor_model_parallel_region(out)
        return out.reshape(B, S, H)


class NeuronGemma4MLP(nn.Module):
    """The dense GeGLU MLP beside the experts (``Gemma4TextMLP``): gate/up column parallel, down
    row parallel (all-reduced)."""

    def __init__(self, config: Gemma4MoEInferenceConfig):
        super().__init__()
        H, I, dtype = config.hidden_size, config.dense_intermediate_size, config.neuron_config.torch_dtype
        self.gate_proj = ColumnParallelLinear(H, I, bias=False, gather_output=False, dtype=dtype)
        self.up_proj = ColumnParallelLinear(H, I, bias=False, gather_output=False, dtype=dtype)
        self.down_proj = RowParallelLinear(I, H, bias=False, input_is_parallel=True, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class NeuronGemma4MoEDecoderLayer(nn.Module):
    """``Gemma4TextDecoderLayer`` (MoE block enabled, no per-layer inputs): the signature and
    return tuple NxDI's ``NeuronBaseModel.get_model_output`` uses,
    ``(hidden, (K, V), cos, sin, residual)``."""

    def __init__(self, config: Gemma4MoEInferenceConfig, layer_idx: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.self_attn = NeuronGemma4Attention(config, layer_idx)
        self.mlp = NeuronGemma4MLP(config)
        self.moe = NeuronGemma4MoE(config)
        for name in LAYER_NORMS:
            setattr(self, name, Gemma4RMSNorm(H, eps, dtype=config.neuron_config.torch_dtype))
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=config.neuron_config.torch_dtype))

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, **kwargs):
        residual = hidden_states
        attn, kv = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_value)
        hidden_states = residual + self.post_attention_layernorm(attn)
        residual = hidden_states
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(hidden_states)))
        experts = self.post_feedforward_layernorm_2(self.moe(residual, self.pre_feedforward_layernorm_2(residual)))
        hidden_states = residual + self.post_feedforward_layernorm(dense + experts)
        hidden_states = hidden_states * self.layer_scalar
        return hidden_states, kv, None, None, None


# ------------------------------------------------------------------------------------------- int8
def convert_to_g4_int8(model: nn.Module) -> None:
    """Swap in NxD's int8 layers for g4's int8-neuron layout (``g4convert int8-neuron``): the
    experts expert-wise per output channel (``QuantizedExpertFused{Column,Row}Parallel``, scales
    ``[E, 1, out]``), the dense MLP and the lm_head per output channel (``QuantizedColumnParallel`` /
    ``QuantizedRowParallel``, scales ``[out, 1]``); attention, router, norms and the embedding stay
    unquantized. NxDI 0.8 applies one global q_config (``models/model_wrapper.py``,
    ``DecoderModelInstance.load_module``), which cannot express this mix, so the class runs NxD's
    ``quantization/quantize.py: convert`` twice itself; ``to_cpu`` never calls ``convert`` at all.

    The int8 layers are built in NxD's AOT mode (``parallel_state.set_aot_mode(True)``, as NxD's
    ``trace/model_builder.py:560`` does for tracing), their parameters left uninitialised: on a CPU
    device NxD ``parallel_layers/layers.py:145,150`` (``_initialize_parameter_cpu``) multiplies the
    partition dim by TP and then overwrites the last dim, so at TP > 1 ``QuantizedRowParallel`` fails
    (``torch.cat(): expected a non-empty list of Tensors``) and the expert gate_up layer is built from
    a wrongly shaped master; AOT mode returns before that (``:140``). Every weight is then loaded
    from the checkpoint. In AOT mode the same function returns the parameter itself as
    ``master_weight`` (``quantization/quantization_layers.py:158``), which would add a second,
    aliased ``master_weight`` key to ``state_dict()``; it is set back to None, what a non-AOT build
    with ``keep_master_weight=False`` holds."""
    from neuronx_distributed.quantization.quantization_config import (
        QuantizationType,
        QuantizedDtype,
        get_default_expert_wise_per_channel_custom_qconfig_dict,
        get_default_per_channel_custom_qconfig_dict,
    )
    from neuronx_distributed.quantization.quantization_layers import QuantizedColumnParallel
    from neuronx_distributed.quantization.quantize import convert

    class SoftcappedQuantizedLMHead(QuantizedColumnParallel):
        softcap = None

        def forward(self, x, *args, **kwargs):
            logits = super().forward(x, *args, **kwargs)
            if not self.softcap:
                return logits
            return (torch.tanh(logits.float() / self.softcap) * self.softcap).to(logits.dtype)

    experts = get_default_expert_wise_per_channel_custom_qconfig_dict()
    dense = get_default_per_channel_custom_qconfig_dict()
    # NxD's expert-wise default is float8_e4m3 (quantization/quantization_config.py); NxDI sets the
    # dtype from neuron_config.quantization_dtype the same way (models/model_wrapper.py). An int8
    # checkpoint loaded into float8 parameters is silently rounded, not refused.
    experts["quantized_dtype"] = dense["quantized_dtype"] = QuantizedDtype.INT8
    aot = parallel_state.get_aot_mode()
    parallel_state.set_aot_mode(True)
    try:
        for layer in model.layers:
            convert(layer.moe.expert_mlps, q_config=experts, inplace=True, mapping=None)
            convert(layer.mlp, q_config=dense, inplace=True, mapping=None)
        old = model.lm_head
        head = SoftcappedQuantizedLMHead(
            input_size=old.input_size, output_size=old.output_size, bias=False, gather_output=old.gather_output,
            quantization_type=QuantizationType.PER_CHANNEL_SYMMETRIC, quantized_dtype=QuantizedDtype.INT8,
            quantization_per_channel_axis=0, dtype=old.weight.dtype)
    finally:
        parallel_state.set_aot_mode(aot)
    head.softcap = old.softcap
    model.lm_head = head
    for module in model.modules():
        if getattr(module, "master_weight", None) is not None and module.master_weight is module.weight:
            del module.master_weight
            module.master_weight = None


# ------------------------------------------------------------------------------------------ model
class NeuronGemma4MoEModel(NeuronBaseModel):
    """The traced part: scaled embedding, decoder layers, final norm, softcapped lm_head, and a
    KV cache with per-layer shapes."""

    def setup_attr_for_model(self, config: Gemma4MoEInferenceConfig):
        self.on_device_sampling = config.neuron_config.on_device_sampling_config is not None
        self.tp_degree = config.neuron_config.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.max_batch_size = config.neuron_config.max_batch_size
        self.buckets = config.neuron_config.buckets
        # sliding windows are applied inside each layer; NxDI's single global window stays off (it
        # would give every layer, full ones included, a window-sized cache)
        self.sliding_window = None
        self.layer_to_cache_size_mapping = list(config.cache_positions())

    def init_model(self, config: Gemma4MoEInferenceConfig):
        dtype = config.neuron_config.torch_dtype
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = Gemma4ScaledEmbedding(config.vocab_size, config.hidden_size, self.padding_idx,
                                                  dtype=dtype, shard_across_embedding=True,
                                                  embed_scale=embed_scale(config.hidden_size, dtype))
        self.layers = nn.ModuleList([NeuronGemma4MoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.lm_head = Gemma4SoftcappedLMHead(config.hidden_size, config.vocab_size, bias=False,
                                              gather_output=not self.on_device_sampling, dtype=dtype,
                                              softcap=config.final_logit_softcapping)
        if config.neuron_config.quantized:
            convert_to_g4_int8(self)

    def init_inference_optimization(self, config: Gemma4MoEInferenceConfig):
        if self.on_device_sampling:
            raise NotImplementedError("on-device sampling is not wired for Gemma 4 yet")
        # attention_chunk_size only selects, in NxDI 0.8's manager, the per-layer token-generation
        # write index ``position % (that layer's cache length)`` (modules/kvcache/kv_cache_manager.py:
        # _get_index_to_update_new_position, lines 595-610; the layout Llama 4's chunked and global
        # layers use, models/llama4/modeling_llama4_text.py:626-650): a sliding layer's ring, and the
        # position itself on a full layer. Its sliding_window path (line 611-612) would write every
        # layer, full ones included, at position % (window - 1). The model keeps attention_chunk_size
        # None (its masks are the layers' own); the manager's _init_kv_shape is Gemma4KVCacheManager's.
        self.kv_mgr = Gemma4KVCacheManager(config, num_kv_head=self.num_key_value_heads, global_rank=self.rank_util,
                                           attention_chunk_size=config.neuron_config.max_length,
                                           layer_to_cache_size_mapping=self.layer_to_cache_size_mapping)


class NeuronGemma4MoEForCausalLM(NeuronBaseForCausalLM):
    """Gemma 4 MoE for NxDI: ``NeuronGemma4MoEForCausalLM(model_path, config)`` with a
    :class:`Gemma4MoEInferenceConfig` (``load_config=load_gemma4_config(model_path)``), then
    ``compile``/``load`` on Neuron or ``to_cpu()`` with ``NeuronConfig(on_cpu=True)``."""

    _model_cls = NeuronGemma4MoEModel

    @classmethod
    def get_config_cls(cls):
        return Gemma4MoEInferenceConfig

    def _get_captured_tensors_offset(self):
        # NxDI 0.8 models/model_base.py:3827,3831 call this; 0.8 defines it only on
        # models/image_to_text_model_base.py:631, whose body this repeats.
        capture = getattr(self.neuron_config, "tensor_capture_config", None)
        return capture.get_offset() if capture else 0

    @classmethod
    def get_state_dict(cls, model_name_or_path: str, config: Gemma4MoEInferenceConfig) -> dict:
        """A ``g4convert int8-neuron`` result (it has a ``manifest.json``) is read by
        :func:`load_g4_int8_neuron` (this process's rank file); anything else is a Hugging Face
        checkpoint read by NxDI.

        Raises:
            NotImplementedError: a result written for TP > 1 asked for as one state dict to shard
                (its files are per rank already; :meth:`load_weights` and :meth:`to_cpu` load them
                rank by rank).
        """
        if is_g4_int8_neuron(model_name_or_path):
            tp = config.neuron_config.tp_degree
            if tp > 1:
                raise NotImplementedError(
                    f"{model_name_or_path} is pre-sharded for TP {tp}: each rank loads its own rank file "
                    "(load_weights on Neuron, to_cpu() on the CPU); NxDI's sharder must not cut it again")
            return load_g4_int8_neuron(model_name_or_path, config, rank=0)
        return super().get_state_dict(model_name_or_path, config)

    def to_cpu(self):
        """NxDI's CPU build (``on_cpu=True``). For a ``g4convert int8-neuron`` result this is NxDI's
        Route 2 (pre-sharded per-rank files read with no key conversion, as
        ``models/application_base.py: load_weights`` does on Neuron): rank r loads
        ``weights/tp{r}_sharded_checkpoint.safetensors`` and no other rank's file
        (:func:`load_g4_int8_neuron`), every key of the module's ``state_dict()`` (but the KV cache)
        required.

        NxDI 0.8's own ``to_cpu`` (``models/application_base.py:554-627``) cannot be reused for that:
        its ``get_neuron_model`` (``:597-608``) always cuts the loaded checkpoint with NxD's
        ``get_sharded_checkpoint``, whose quantized layers require the full tensors. So for a g4
        result this method takes NxDI's steps itself, in its order: ``NXD_CPU_MODE=1``, its dtype
        checks, the gloo group (``WORLD_SIZE`` from torchrun, else a world of 1), NxD's
        ``initialize_model_parallel(..., skip_collective_init=True)``, one module shared by every
        wrapper (with continuous batching one per wrapper, as NxDI's), ``eval()``; the load is the
        rank file's. The module is built as NxDI builds the one
        it traces for Neuron (``DecoderModelInstance.load_module``, ``models/model_wrapper.py:1454``:
        floating tensors cast to ``torch_dtype``, then every parameter named ``*scale`` back to fp32,
        then NxD's ``convert`` with the global q_config), so the CPU runs Neuron's dtypes. Any other checkpoint goes through NxDI's ``to_cpu`` unchanged.

        Raises:
            CheckpointError: a result written for another TP degree than ``tp_degree``, a missing
                or malformed rank file, or a rank file whose keys are not the module's.
            ValueError: int8 weights without ``NeuronConfig(quantized=True)``.
            NotImplementedError: what NxDI's ``to_cpu`` refuses (bf16 at TP > 1, fp16,
                speculation), or int8 attention.
        """
        if not is_g4_int8_neuron(self.model_path):
            return super().to_cpu()
        nc = self.neuron_config
        _check_g4_int8_neuron(self.model_path, self.config)  # before any process group is opened
        if nc.torch_dtype == torch.bfloat16 and nc.tp_degree > 1:
            raise NotImplementedError("gloo has no bfloat16 all-reduce: use float32 on the CPU at TP > 1")
        if nc.torch_dtype == torch.float16 or nc.speculation_length > 0:
            raise NotImplementedError("fp16 and speculation are not supported on the CPU here")
        os.environ["NXD_CPU_MODE"] = "1"
        if "WORLD_SIZE" in os.environ:
            if int(os.environ["WORLD_SIZE"]) != nc.world_size:
                raise ValueError(f"WORLD_SIZE {os.environ['WORLD_SIZE']} is not the NeuronConfig's world size "
                                 f"{nc.world_size}")
            if not torch.distributed.is_initialized():
                torch.distributed.init_process_group("gloo")
        if not torch.distributed.is_initialized():
            if nc.world_size != 1:
                raise RuntimeError("TP > 1 on the CPU needs one process per rank (torchrun)")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            torch.distributed.init_process_group(backend="gloo", world_size=1, rank=0)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=nc.tp_degree,
                                                 pipeline_model_parallel_size=nc.pp_degree,
                                                 expert_model_parallel_size=nc.ep_degree, skip_collective_init=True)
        # the module NxDI traces on Neuron: the model wrapper's DecoderModelInstance.load_module()
        # (models/model_wrapper.py:1454-1530: cast_type casts, fp32 ``*scale`` parameters, the
        # global q_config convert), not NxDI's CPU build (model_cls(config) then .bfloat16())
        sd = load_g4_int8_neuron(self.model_path, self.config, rank=torch.distributed.get_rank())
        # continuous batching: one module per wrapper, built from that wrapper's config (context
        # encoding at ctx_batch_size, token generation at tkg_batch_size), as NxDI's own to_cpu does
        # (models/application_base.py:610-620); NxDI copies each call's KV cache into both modules'
        # managers (models/model_base.py:3480-3482, _copy_past_key_values). Otherwise one shared module.
        wrappers = self.models if nc.is_continuous_batching else self.models[:1]
        modules = []
        for wrapper in wrappers:
            instance = wrapper.get_model_instance()
            instance.load_module()
            _load_rank_state(instance.module, sd, self.model_path)
            modules.append(instance.module)
        for i, wrapper in enumerate(self.models):
            wrapper.model = modules[i if nc.is_continuous_batching else 0]
        self.eval()

    def load_weights(self, compiled_model_path, start_rank_id=None, local_ranks_size=None):
        """NxDI's weight load after ``load`` (``models/application_base.py:374-415``). For a
        ``g4convert int8-neuron`` result at any TP degree this is NxDI's Route 2 (pre-sharded
        per-rank files handed to ``traced_model.nxd_model.initialize(weights, start_rank)`` with no
        key conversion, ``:388-399,411-412``), the files read from the result itself
        (``weights/tp{r}_sharded_checkpoint.safetensors``, :meth:`g4_rank_weights`), not from copies
        in ``compiled_model_path``. NxDI's Route 1 (``save_sharded_checkpoint=False``: shard a whole
        checkpoint at load) cannot take such a result at TP > 1 (:meth:`get_state_dict`). Any other
        checkpoint: NxDI's own ``load_weights``.

        Raises:
            ValueError: ``load`` has not traced the model in (NxDI's own check).
            CheckpointError: see :meth:`g4_rank_weights`.
        """
        if not is_g4_int8_neuron(self.model_path):
            return super().load_weights(compiled_model_path, start_rank_id=start_rank_id,
                                        local_ranks_size=local_ranks_size)
        if self.traced_model is None:
            raise ValueError("Model is not loaded")
        nc = self.neuron_config
        start = nc.start_rank_id if start_rank_id is None else start_rank_id
        count = nc.local_ranks_size if local_ranks_size is None else local_ranks_size
        weights = self.g4_rank_weights(start, count)
        self.traced_model.nxd_model.initialize(weights, torch.tensor([start], dtype=torch.int32, device="cpu"))

    def g4_rank_weights(self, start_rank_id: int, local_ranks_size: int) -> List[dict]:
        """The per-rank weights NxD's ``NxDModel.initialize(checkpoint, start_rank)`` takes
        (aws-neuron/neuronx-distributed ``src/neuronx_distributed/trace/spmd.py``: one dict per local
        rank, ``start_rank_id .. start_rank_id + local_ranks_size - 1``) for this ``g4convert
        int8-neuron`` result: what NxD's ``ModelBuilder.shard_checkpoint``
        (``trace/model_builder.py:802-843``) hands over on Route 1, without its cut, since each rank
        file is already that rank's cut.

        Taken in ``shard_checkpoint``'s order: the module NxDI traces (the first model wrapper's
        ``DecoderModelInstance.load_module()``, so with NxDI's ``cast_type`` casts and its global
        q_config ``convert`` on top of this class's own int8 layers) is built on the meta device in
        NxD's mocked process group; each rank's file is read (:func:`load_g4_int8_neuron`, its
        header checked against g4's layout table first; tensors memory-mapped by safetensors); its
        keys must be the module's ``state_dict()`` keys but the KV cache (``kv_mgr.*``, state NxD
        allocates); each tensor is cast to the module parameter's dtype by NxD's
        ``ModelBuilder.cast_weights`` (``:786-800``: fp32 norms and router to ``torch_dtype``,
        int8 weights and fp32 scales unchanged) and must have the module's per-rank shape.

        Returns: ``local_ranks_size`` dicts of name -> tensor (int8 weights, fp32 scales, the rest in
        ``torch_dtype``; NxD's rank indices int32).

        Raises:
            CheckpointError: a result for another TP degree, a missing or malformed rank file, a
                rank file whose keys or shapes are not the traced module's.
            ValueError: ``NeuronConfig(quantized=True)`` is not set.
        """
        from neuronx_distributed.trace.mock_torchdist import mock_distributed
        from neuronx_distributed.utils.model_utils import init_on_device

        nc = self.neuron_config
        _check_g4_int8_neuron(self.model_path, self.config)
        if not 0 <= start_rank_id < start_rank_id + local_ranks_size <= nc.tp_degree:
            raise ValueError(f"ranks {start_rank_id}..{start_rank_id + local_ranks_size - 1} are not ranks of TP "
                             f"{nc.tp_degree}")
        builder = self.get_builder()
        weights = []
        with mock_distributed(world_size=nc.world_size), init_on_device(torch.device("meta"),
                                                                        force_custom_init_on_device=True):
            torch.distributed.init_process_group(backend="xla", rank=0, world_size=nc.world_size)
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=nc.tp_degree,
                                                     pipeline_model_parallel_size=nc.pp_degree,
                                                     expert_model_parallel_size=nc.ep_degree,
                                                     skip_collective_init=True, lnc_size=nc.logical_nc_config)
            try:
                instance = self.models[0].get_model_instance()
                instance.load_module()
                module = instance.module
                want = {k: v for k, v in module.state_dict().items() if not k.startswith("kv_mgr.")}
                for rank in range(start_rank_id, start_rank_id + local_ranks_size):
                    sd = load_g4_int8_neuron(self.model_path, self.config, rank=rank)
                    if set(sd) != set(want):
                        missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
                        raise CheckpointError(f"{self.model_path}: rank {rank} file keys are not the traced module's "
                                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
                    builder.cast_weights(sd, module, "")
                    for name, tensor in sd.items():
                        if tuple(tensor.shape) != tuple(want[name].shape):
                            raise CheckpointError(f"{self.model_path}: rank {rank} tensor {name} has shape "
                                                  f"{list(tensor.shape)}, the traced module {list(want[name].shape)}")
                    weights.append(sd)
            finally:
                parallel_state.destroy_model_parallel()
                torch.distributed.destroy_process_group()
        return weights

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict: dict, config: Gemma4MoEInferenceConfig) -> dict:
        """Hugging Face Gemma 4 names (after NxDI strips the leading ``model.``) to this class's,
        through g4's int8-neuron layout table (``g4.exporters.neuron_int8``, whose keys are this
        class's module names): ``language_model.`` dropped (vision tower and ``embed_vision``
        dropped), ``router.*`` -> ``moe.router.*``, ``experts.gate_up_proj [E, 2I, H]`` ->
        ``moe.expert_mlps.mlp_op.gate_up_proj.weight [E, H, 2I]`` (gate columns first, as NxD's
        fused layout), ``experts.down_proj [E, H, I]`` -> ``...down_proj.weight [E, I, H]``;
        ``k_proj`` / ``v_proj`` rows replicated per KV head where there are fewer KV heads than ranks
        (:func:`replicate_kv_rows`); NxD's rank indices set to ``arange(tp)`` (NxD's sharder gives
        rank r ``[r]``); the pre-release ``moe.*`` expert names are accepted.

        Raises:
            KeyError: a decoder-layer tensor the table does not know, or an untied model without
                ``lm_head.weight``.
        """
        tp = config.neuron_config.tp_degree
        out = {}
        for name, tensor in state_dict.items():
            if name.startswith("language_model."):
                name = name[len("language_model."):]
            elif name.startswith(("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")):
                continue
            if name.startswith("layers."):
                _, layer, rel = name.split(".", 2)
                layer = int(layer)
                # pre-release expert names (moe.gate_up_proj, moe.per_expert_scale): the release's
                rel = "router.per_expert_scale" if rel == "moe.per_expert_scale" else rel
                rel = "experts." + rel[len("moe."):] if rel.startswith("moe.") else rel
                entry = entry_of(rel)
                name = entry.names(layer_prefix(layer))[0]
                if entry.rule in (EXPERT_GATE_UP, EXPERT_DOWN):
                    tensor = tensor.transpose(1, 2).contiguous()
                elif entry.rule is KV_HEADS:
                    tensor = replicate_kv_rows(tensor, config.kv_heads_of(layer), config.head_dim_of(layer), tp)
            out[name] = tensor
        ranks = torch.arange(0, tp, dtype=torch.int32)
        for e in model_entries(tied=config.tie_word_embeddings):
            if is_rank_index(e):
                out[e.names("")[0]] = ranks
        for layer in range(config.num_hidden_layers):
            for e in layer_entries(has_v=True, quantize_attention=False):
                if is_rank_index(e):
                    out[e.names(layer_prefix(layer))[0]] = ranks
        if not config.tie_word_embeddings and LM_HEAD not in out:
            raise KeyError("tie_word_embeddings is false but the checkpoint has no lm_head.weight")
        return out

    @staticmethod
    def update_state_dict_for_tied_weights(state_dict):
        state_dict[LM_HEAD] = state_dict["embed_tokens.weight"].clone()


def is_g4_int8_neuron(path: str) -> bool:
    """``path`` is a ``g4convert int8-neuron`` result (a directory with its ``manifest.json``)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def _check_g4_int8_neuron(out_dir: str, config: Gemma4MoEInferenceConfig) -> Manifest:
    manifest = Manifest.from_dir(out_dir)
    tp = config.neuron_config.tp_degree
    if manifest.tp_degree != tp:
        raise CheckpointError(f"{out_dir} was written for TP {manifest.tp_degree} (g4convert int8-neuron --tp "
                              f"{manifest.tp_degree}), the NeuronConfig has tp_degree {tp}: convert again with "
                              f"--tp {tp} or set tp_degree={manifest.tp_degree}")
    if not config.neuron_config.quantized:
        raise ValueError(f"{out_dir} holds int8 weights: build with NeuronConfig(quantized=True)")
    if manifest.quantize_attention:
        raise NotImplementedError(f"{out_dir} has int8 attention (--quantize-attention); this class keeps "
                                  "attention unquantized so far")
    return manifest


def load_g4_int8_neuron(out_dir: str, config: Gemma4MoEInferenceConfig, rank: Optional[int] = None) -> dict:
    """TP rank ``rank``'s state dict of this class from a ``g4convert int8-neuron`` result: its file
    ``weights/tp{rank}_sharded_checkpoint.safetensors`` alone, whose keys, dtypes and per-rank shapes
    are this class's ``state_dict()`` (g4's layout table, ``g4.exporters.neuron_int8``; checked by
    ``g4.serve.neuron_runtime.load_rank_weights``), with no renaming: int8 ``weight`` and fp32
    ``scale`` (experts ``[E, H, 2I/T]`` / ``[E, I/T, H]``, expert-wise scales ``[E, 1, out]``), the
    int8 lm_head (not tied to the bf16 embedding), the device embedding shard ``[V, H/T]`` (unscaled;
    the embedding module applies ``sqrt(H)``), NxD's rank indices ``[rank]``. Floating tensors stay
    in the file's dtype (``load_state_dict`` casts them to the module's).

    ``rank``: default this process's TP rank (0 when NxD's parallel state is not initialised).
    Needs ``neuron_config.quantized`` (the class then builds NxD's int8 layers,
    :func:`convert_to_g4_int8`) and the result's TP degree.

    Raises:
        CheckpointError: another TP degree than ``tp_degree``, or a missing / malformed rank file.
        ValueError: ``quantized`` is not set.
    """
    _check_g4_int8_neuron(out_dir, config)
    if rank is None:
        rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    return load_rank_weights(out_dir, ranks=[rank])[0]


def _load_rank_state(module: nn.Module, sd: dict, out_dir: str) -> None:
    """``sd`` into ``module``, every key of ``module.state_dict()`` but the KV cache required and no
    other (the KV cache buffers ``kv_mgr.*`` are state, not weights)."""
    own = {k for k in module.state_dict() if not k.startswith("kv_mgr.")}
    if own != set(sd):
        missing, extra = sorted(own - set(sd)), sorted(set(sd) - own)
        raise CheckpointError(f"{out_dir}: rank file keys are not the module's (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})")
    module.load_state_dict(sd, strict=False)


@torch.no_grad()
def greedy_generate(model: NeuronGemma4MoEForCausalLM, prompt: List[int], max_new_tokens: int):
    """Greedy decoding through ``NeuronBaseForCausalLM.forward`` (context encoding on the prompt,
    then one token-generation call per new token on the KV cache), batch 1. Returns the new ids and
    the logits of each step ``[steps, vocab]`` (fp32). Used instead of NxDI's
    ``HuggingFaceGenerationAdapter`` (see the module docstring)."""
    model.reset()
    ids = torch.tensor([prompt], dtype=torch.long)
    positions = torch.arange(len(prompt), dtype=torch.long)[None]
    seq_ids = torch.zeros(1, dtype=torch.int32)
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, position_ids=positions, seq_ids=seq_ids,
                    attention_mask=(positions >= 0).long() if ids.shape[1] > 1 else None)
        step = out.logits[:, -1, :].float()
        nxt = int(step.argmax(-1))
        logits.append(step[0])
        tokens.append(nxt)
        last = int(positions[0, -1])
        ids = torch.tensor([[nxt]], dtype=torch.long)
        positions = torch.tensor([[last + 1]], dtype=torch.long)
    return tokens, torch.stack(logits)
