"""Memory plan of a Gemma 4 MoE model for a target, from the config alone (no weights read).

``g4convert plan SRC_OR_CONFIG --format int8-neuron --tp 2 --target inf2.xlarge`` (or
``--gpu-mem 128GiB``) prints, per tensor-parallel rank, the bytes of every weight group,
the bf16 KV cache as the serving engine allocates it (:func:`kv_cache_vllm` on a GPU,
:func:`kv_cache_nxdi` on Neuron), the device memory of the target and whether it fits, and
for Neuron targets the host RAM that loading needs.

Units: every figure is an integer number of **bytes**; the report shows it also as
**GB = 10**9 bytes** and **GiB = 2**30 bytes** (the specs use both; mixing them is how
"49 GB" figures happen).

Sources:

- geometry, ``attention_k_eq_v``, the ``per_layer_config`` form and the tensors each layer
  has (hence parameter groups, bytes per format and KV cache per token): huggingface/transformers
  5.24 ``src/transformers/models/gemma4/configuration_gemma4.py`` and ``modeling_gemma4.py``
  (read through ``g4.core.gemma4``);
- which int8 layers split which dim, which fp32 scales are split or replicated, expert-wise
  scales ``[E, 1, out]``: aws-neuron/neuronx-distributed
  ``src/neuronx_distributed/quantization/quantization_layers.py`` and ``trace/trace.py``
  (``create_local_weight``);
- the runtime loads every local rank's file before ``initialize``:
  aws-neuron/neuronx-distributed-inference ``src/neuronx_distributed_inference/models/application_base.py``;
- NeuronCores, 16 GiB HBM per core, TP degrees, host RAM per instance: aws-neuron/aws-neuron-sdk
  ``about-neuron/arch/neuron-hardware/inf2-arch.rst``, ``trn1-arch.rst`` and
  ``libraries/nxd-inference/developer_guides/feature-guide.rst``.

Weights per rank. The ``int8-neuron`` plan is the ``nbytes`` of the tensors ``g4convert
int8-neuron`` writes into one rank file, from the same layout table and sharding rules
(:func:`g4.exporters.neuron_int8.expected_rank_specs`; only the bf16 lm_head variants and a
device embedding are weighed beyond what the exporter writes), so the plan cannot drift from the
files. The GPU formats (``nvfp4``, ``bf16``) are costed by the formulas below with the same
rules (per rank, TP degree ``tp``):

- column-parallel (q/k/v, dense gate/up, expert gate_up, lm_head): output rows split;
- row-parallel (o_proj, dense down, expert down): input columns split;
- KV heads: :func:`g4.core.gemma4.kv_heads_per_rank` (whole heads replicated when
  ``tp > kv``, which needs ``tp % kv == 0``);
- norms, ``layer_scalar`` and routers: replicated bf16.

Neuron plans also count the fp32 logits each compiled NxDI bucket graph outputs
(:func:`nxdi_logits_bytes`) and the attention scores of the largest context-encoding bucket
(:func:`nxdi_context_attention_bytes`), the one activation that grows with the square of the
prompt. What is not counted: other activations, compiler scratchpad, compiled graphs, CUDA
context and graphs, the runtime itself. The margin is what is left for those.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.convert.resolve import EMBEDDED, resolve_source, source_name
from g4.convert.synth import PRESETS
from g4.core.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, Checkpoint, quantized_reason, read_json_object
from g4.core.errors import CheckpointError, G4Error, a_or_an
from g4.core.gemma4 import (
    LAYER_NORMS,
    NVFP4_BLOCK as _NVFP4_BLOCK,
    VISION_PREFIXES,
    Architecture,
    KvCacheLayer,
    kv_cache_layers,
    kv_cache_positions,
    read_architecture,
    tower_of,
    tp_refusal,
)
from g4.core.sizes import format_bytes
from g4.exporters.formats import BF16, FACTS_FILE, INT8_NEURON, NVFP4, detect_format
from g4.exporters.neuron_int8 import (
    RANK_INDEX_KIND,
    Manifest,
    expected_rank_specs,
    neuron_buckets,
    parse_rank_name,
    serving_max_context_length,
)

GB = 10**9
GiB = 2**30

FORMATS = (INT8_NEURON, NVFP4, BF16)
LM_HEADS = ("int8-sharded", "bf16-sharded", "bf16-replicated", "tied")
ATTENTIONS = ("bf16", "int8", "nvfp4")
EMBEDDINGS = ("host", "device")
KNOWN_MODELS = ("gemma-4-26B-A4B",)  # convert/synth.py PRESETS

_BF16 = 2  # bytes per bf16 element
# Host RAM of the Neuron deploy's weight hand-over (g4serve --backend neuron: g4_rank_weights, NxD's
# cast_weights, nxd_model.initialize), measured by bench/bench_inf2_deploy.py on gemma-4-26B-A4B at TP 2
# at its real size (2 x 13.98 GB rank files, cold) in memory cgroups of 14 and 4 GiB: the peak of
# anonymous memory (RssAnon) was 1.13 and 1.19 GiB, and the load completed in both. The rank files are
# memory-mapped (safetensors) and each byte is read once: their pages are page cache the kernel
# drops under the limit, so the load keeps none of it (HOST_PAGE_CACHE_KEPT).
HOST_LOAD_ANON_BYTES = 1_281_818_624  # 1.19 GiB, the larger of the two peaks (RssAnon)
HOST_PAGE_CACHE_KEPT = 0
# What the OS, the Neuron runtime's host side and g4serve's HTTP server and tokenizer take beside
# the load: an allowance, not measured on an inf2 (nothing here runs there).
HOST_RESERVE_BYTES = 2 * GiB
_FP32 = 4  # bytes per fp32 element (NxDI's logits)
_NVFP4_SCALARS = 8  # fp32 weight_scale_2 + fp32 input_scale per exported linear (W4A4)
_QUANT = {INT8_NEURON: "int8", NVFP4: "nvfp4", BF16: "bf16"}  # dtype of the experts and dense MLP


@dataclass(frozen=True)
class NeuronTarget:
    """An AWS Neuron instance (aws-neuron/aws-neuron-sdk ``about-neuron/arch/neuron-hardware/inf2-arch.rst``,
    ``trn1-arch.rst``).

    Attributes:
        name: EC2 instance type.
        neuron_cores: NeuronCore-v2 count; one TP rank per core (LNC = 1).
        host_ram_bytes: instance RAM in bytes.
        tp_degrees: the TP degrees NxDI documents for this family.
        hbm_per_core_bytes: device memory of one core, 16 GiB.
    """

    name: str
    neuron_cores: int
    host_ram_bytes: int
    tp_degrees: tuple[int, ...]
    hbm_per_core_bytes: int = 16 * GiB


_INF2_TP = (1, 2, 4, 8, 24)
_TRN1_TP = (1, 2, 8, 16, 32)
NEURON_TARGETS: dict[str, NeuronTarget] = {t.name: t for t in (
    NeuronTarget("inf2.xlarge", 2, 16 * GiB, _INF2_TP),
    NeuronTarget("inf2.8xlarge", 2, 128 * GiB, _INF2_TP),
    NeuronTarget("inf2.24xlarge", 12, 384 * GiB, _INF2_TP),
    NeuronTarget("inf2.48xlarge", 24, 768 * GiB, _INF2_TP),
    NeuronTarget("trn1.2xlarge", 2, 32 * GiB, _TRN1_TP),
    NeuronTarget("trn1.32xlarge", 32, 512 * GiB, _TRN1_TP),
)}


# --------------------------------------------------------------------------- bytes


def _matrix_bytes(dtype: str, rows: int, cols: int) -> int:
    """Bytes one GPU rank stores for a ``[rows, cols]`` slice of a weight matrix.

    ``dtype``: ``bf16`` (2 bytes per element) or ``nvfp4`` (``n/2`` bytes of e2m1 codes,
    ``n/16`` float8_e4m3 block scales, plus the fp32 ``weight_scale_2`` and ``input_scale``
    of the linear; NVIDIA/Model-Optimizer
    ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``). int8 is costed from the
    int8-neuron layout table (:func:`neuron_int8_weight_bytes`), not here.
    """
    n = rows * cols
    if dtype == "bf16":
        return n * _BF16
    if dtype == "nvfp4":
        return n // 2 + rows * (cols // _NVFP4_BLOCK) + _NVFP4_SCALARS
    raise G4Error(f"unknown weight dtype {dtype!r}")


def _column(dtype: str, out_per_rank: int, inp: int) -> int:
    """Column-parallel slice: this rank's output rows."""
    return _matrix_bytes(dtype, out_per_rank, inp)


def _row(dtype: str, out: int, inp_per_rank: int) -> int:
    """Row-parallel slice: this rank's input columns."""
    return _matrix_bytes(dtype, out, inp_per_rank)


def _experts_bytes(g: Architecture, dtype: str, tp: int) -> int:
    """Per-rank bytes of every layer's experts on a GPU. NVFP4: each expert is exported as
    separate gate/up/down linears (``exporters/nvfp4_names.py``), each with its scalars."""
    E, H, i = g.experts, g.hidden, g.moe_intermediate // tp
    if dtype == "nvfp4":
        gate_up = E * 2 * _column(dtype, i, H)
        down = E * _row(dtype, H, i)
    else:
        gate_up, down = E * 2 * i * H * _BF16, E * H * i * _BF16
    return len(g.layers) * (gate_up + down)


def _dense_mlp_bytes(g: Architecture, dtype: str, tp: int) -> int:
    i = g.intermediate // tp
    return len(g.layers) * (2 * _column(dtype, i, g.hidden) + _row(dtype, g.hidden, i))


def _attention_bytes(g: Architecture, dtype: str, tp: int) -> int:
    """q/k/v column-parallel by heads (KV heads replicated when fewer than ranks), o row-parallel."""
    total = 0
    for layer, cache in zip(g.layers, kv_cache_layers(g.layers, tp)):
        q = g.heads // tp * layer.head_dim
        kv = cache.heads * cache.head_dim
        total += _column(dtype, q, g.hidden) + _column(dtype, kv, g.hidden) * (2 if layer.has_v else 1)
        total += _row(dtype, g.hidden, q)
    return total


# Plan group of each model part of the int8-neuron table (g4.core.gemma4.LAYER_MODULE_KINDS and
# MODEL_MODULE_KINDS, read back through g4.exporters.neuron_int8.parse_rank_name).
# NxD's rank indices (int32 [1], one per layer and one for the model) are counted with the norms.
_GROUP_OF_KIND = {"experts": "experts", "lm_head": "lm_head", "dense MLP": "dense_mlp", "attention": "attention",
                  "norms": "norms_and_routers", "routers": "norms_and_routers", "layer scalars": "norms_and_routers",
                  "token embedding": "embedding", RANK_INDEX_KIND: "norms_and_routers"}


def neuron_int8_weight_bytes(config: dict, tp: int, *, attention: str, lm_head: str) -> dict[str, int]:
    """Device weight bytes on one rank of an int8-neuron result, by plan group (``experts``,
    ``lm_head``, ``dense_mlp``, ``attention``, ``norms_and_routers``, ``embedding``): the ``nbytes``
    of every tensor ``g4convert int8-neuron`` writes into one rank file, from the exporter's own
    layout table and rules (:func:`g4.exporters.neuron_int8.expected_rank_specs`, bf16 source
    tensors). The embedding is the bf16 column shard g4's NxDI class holds on the device
    (:data:`g4.exporters.neuron_int8.DEVICE_EMBEDDING`), in every rank file.

    Args:
        attention: ``bf16`` or ``int8`` (``--quantize-attention``).
        lm_head: ``int8-sharded`` (what the exporter writes), ``bf16-sharded`` or ``bf16-replicated``.

    Raises:
        G4Error: a TP degree the model cannot be split over.
    """
    groups = dict.fromkeys(("experts", "lm_head", "dense_mlp", "attention", "norms_and_routers", "embedding"), 0)
    for spec in expected_rank_specs(config, tp, quantize_attention=attention == "int8", lm_head=lm_head):
        groups[_GROUP_OF_KIND[parse_rank_name(spec.name).kind]] += spec.nbytes
    return groups


def _norms_and_routers_bytes(g: Architecture) -> int:
    """Replicated bf16: 7 hidden-size norms per MoE layer, q_norm and k_norm (head_dim; v_norm
    has no weight), ``layer_scalar`` [1], router ``proj`` [E, H], ``scale`` [H] and
    ``per_expert_scale`` [E], and the final norm [H]."""
    per_layer = sum(len(LAYER_NORMS) * g.hidden + 2 * layer.head_dim + 1 for layer in g.layers)
    routers = len(g.layers) * (g.experts * g.hidden + g.hidden + g.experts)
    return (per_layer + routers + g.hidden) * _BF16


VLLM_BLOCK_TOKENS = 16  # tokens per KV block when --block-size is not given
VLLM_BATCHED_TOKENS = 2048  # vllm serve's --max-num-batched-tokens below 70 GiB of GPU memory
VLLM_BATCHED_TOKENS_LARGE_GPU = 8192  # ... from 70 GiB up (not on an A100)
_VLLM_LARGE_GPU_BYTES = 70 * GiB
# vllm serve's --gpu-memory-utilization: the share of each GPU's total memory vLLM may use
# (weights, KV cache, activations); vllm-project/vllm vllm/config/cache.py (CacheConfig).
VLLM_GPU_MEMORY_UTILIZATION = 0.9


def vllm_default_batched_tokens(gpu_mem_bytes: int | None) -> int:
    """vLLM's default ``--max-num-batched-tokens`` (tokens) for ``vllm serve`` on one GPU of
    ``gpu_mem_bytes`` bytes (None: unknown): 8192 from 70 GiB up, else 2048.

    Source: vllm-project/vllm ``vllm/engine/arg_utils.py``, ``EngineArgs.get_batch_defaults``
    (usage context ``OPENAI_API_SERVER``; an unknown memory counts as 0). vLLM gives an A100
    of 80 GB 2048; the plan then reserves more than vLLM does (it errs towards DOES NOT
    FIT); pass ``--max-num-batched-tokens 2048`` for it.
    """
    return VLLM_BATCHED_TOKENS_LARGE_GPU if (gpu_mem_bytes or 0) >= _VLLM_LARGE_GPU_BYTES else VLLM_BATCHED_TOKENS


@dataclass(frozen=True)
class KvCache:
    """KV cache bytes on one rank for all sequences, split into sliding and full layers."""

    sliding: int
    full: int

    @property
    def total(self) -> int:
        """``sliding + full`` bytes."""
        return self.sliding + self.full


def _kv_bytes_per_token(layer: KvCacheLayer, dtype_bytes: int = _BF16) -> int:
    """K and V of one layer for one token on one rank (:class:`g4.core.gemma4.KvCacheLayer`:
    K and V are both cached on full layers with ``attention_k_eq_v`` too)."""
    return layer.heads * layer.head_dim * 2 * dtype_bytes


def kv_cache_vllm(g: Architecture, tp: int, seq_len: int, batch: int, max_num_batched_tokens: int) -> KvCache:
    """The KV cache vLLM reserves per rank, in bytes, for ``batch`` sequences of ``seq_len``
    tokens (its ``--max-model-len``) at ``max_num_batched_tokens`` tokens per scheduler step.

    Rules (vllm-project/vllm, V1 engine with its default hybrid KV cache manager):

    - ``vllm/v1/kv_cache_interface.py`` ``SlidingWindowSpec.max_memory_usage_bytes``: a
      sliding layer holds ``min(sliding_window - 1 + max_num_batched_tokens, seq_len)``
      tokens in whole blocks, plus one block (the window need not start on a block
      boundary); ``FullAttentionSpec.max_memory_usage_bytes``: a full layer ``seq_len``
      tokens in whole blocks.
    - ``vllm/v1/core/kv_cache_utils.py`` ``unify_kv_cache_spec_page_size``: all blocks have
      the bytes of the largest; a layer with fewer bytes per token gets proportionally more
      tokens per block (26B-A4B: 16 on sliding layers, 32 on full ones); the same file's
      ``check_enough_kv_cache_memory`` refuses to start when one sequence does not fit.
    - ``vllm/platforms/cuda.py``: 16 tokens per block unless ``--block-size`` is given.
    """
    layers = kv_cache_layers(g.layers, tp)
    per_token = [_kv_bytes_per_token(layer) for layer in layers]
    page = max(per_token) * VLLM_BLOCK_TOKENS  # bytes of every block after page-size unification
    sliding = full = 0
    for layer, t in zip(layers, per_token):
        block = page // t if page % t == 0 else VLLM_BLOCK_TOKENS  # otherwise vLLM pads the page
        if layer.sliding:
            tokens = min(g.sliding_window - 1 + max_num_batched_tokens, seq_len)
            sliding += (math.ceil(tokens / block) + 1) * page
        else:
            full += math.ceil(seq_len / block) * page
    return KvCache(sliding * batch, full * batch)


def kv_cache_nxdi(g: Architecture, tp: int, max_length: int, batch: int, *, padding: int = 0,
                  dtype_bytes: int = _BF16) -> KvCache:
    """The KV cache g4's NxDI model class allocates per rank, in bytes: per layer its positions
    (:func:`g4.core.gemma4.kv_cache_positions`: ``max_length`` on a full layer, a ring of
    ``min(sliding_window - 1, max_length)`` on a sliding one) for ``batch + padding`` sequences,
    that layer's KV heads per rank and head dim (:func:`g4.core.gemma4.kv_cache_layers`), K and V,
    ``dtype_bytes`` per element (bf16: 2). The class's ``Gemma4KVCacheManager`` reads the same two
    functions.

    Rule: ``g4.serve.nxdi_gemma4.NeuronGemma4MoEModel.setup_attr_for_model`` passes those positions
    as ``layer_to_cache_size_mapping``, and NxDI 0.8 allocates one
    ``[batch, heads, positions, head_dim]`` K and V buffer per layer from it
    (aws-neuron/neuronx-distributed-inference
    ``src/neuronx_distributed_inference/modules/kvcache/kv_cache_manager.py``, ``__init__`` /
    ``_init_kv_shape`` / ``get_kv_shapes``: batch ``kv_cache_batch_size + kv_cache_padding_size``,
    both defaulting to the batch size and 0 in ``models/config.py``; dtype ``attention_dtype``
    or ``torch_dtype``). Not counted: the 128 extra positions NxDI adds per layer with
    ``apply_seq_ids_mask`` (off by default; g4's manager does not add them), KV quantization.

    Args:
        g: the architecture.
        tp: tensor-parallel degree.
        max_length: ``neuron_config.max_length`` (the plan's ``seq_len``), positions.
        batch: ``max_batch_size`` (= ``kv_cache_batch_size``), sequences.
        padding: ``kv_cache_padding_size``, sequences.
        dtype_bytes: bytes per cached element.
    """
    layers = kv_cache_layers(g.layers, tp)
    positions = kv_cache_positions(g.layers, max_length, g.sliding_window)
    seqs = batch + padding
    sliding = sum(_kv_bytes_per_token(layer, dtype_bytes) * n for layer, n in zip(layers, positions) if layer.sliding)
    full = sum(_kv_bytes_per_token(layer, dtype_bytes) * n for layer, n in zip(layers, positions) if not layer.sliding)
    return KvCache(sliding * seqs, full * seqs)


def nxdi_buckets(max_length: int, *, enable_bucketing: bool = False,
                 max_context_length: int | None = None) -> tuple[list[int], list[int]]:
    """``(context_encoding, token_generation)`` buckets (positions) NxDI 0.8 compiles one graph each
    for, as its defaults give them (aws-neuron/neuronx-distributed-inference
    ``src/neuronx_distributed_inference/modules/autobucketing.py``: ``generate_buckets_for_cte`` up
    to ``max_context_length`` (default ``max_length``), ``generate_buckets_for_tkg`` up to
    ``max_length`` = ``seq_len``, ``generate_buckets``; no prefix caching or chunked prefill).
    Without bucketing (NxDI's default): one of each, ``[max_context_length]`` and ``[max_length]``.
    With it: ``2**i`` from 128 below ``round(log2(n))``, then ``n`` itself (so ``[n]`` alone up to
    181 positions), for each of the two lengths."""
    prompt = max_context_length or max_length
    if not enable_bucketing:
        return [prompt], [max_length]
    # the ladders the int8-neuron manifest records and serving compiles
    return neuron_buckets(prompt), neuron_buckets(max_length)


def nxdi_context_attention_bytes(g: Architecture, tp: int, bucket: int, *, dtype_bytes: int = _BF16) -> int:
    """Bytes per rank of the attention scores one context-encoding call of ``bucket`` positions
    holds in g4's NxDI class: fp32 scores and their ``dtype_bytes`` probabilities, ``[1, heads/T,
    S, S]`` each (``g4.serve.nxdi_gemma4.NeuronGemma4Attention.forward``: ``matmul(q, k^T)`` in
    fp32, masked, then softmax cast to the model dtype; sliding layers too, their window being a
    mask over the whole bucket), for one layer (layers run one after another), one sequence
    (NxDI encodes one prompt per call, ``ctx_batch_size`` 1). The figure grows with ``S**2``: the
    longest prompt, not the KV cache, bounds what fits. An upper bound where the compiler fuses
    the softmax."""
    return (g.heads // tp) * bucket * bucket * (_FP32 + dtype_bytes)


def nxdi_logits_bytes(g: Architecture, batch: int, buckets: tuple[list[int], list[int]]) -> int:
    """Bytes of the logits each compiled NxDI graph outputs on a rank: ``[batch, 1, vocab]`` fp32 per
    bucket, context encoding and token generation. NxDI keeps only the last position's hidden state
    before the lm_head (``models/model_base.py``, ``NeuronBaseModel.forward``: ``torch.gather`` at the
    largest position id; only ``output_logits=True`` returns every position) and casts the logits to
    fp32; g4's class gathers the vocabulary on every rank (its lm_head has ``gather_output=True``
    while on-device sampling is off), so each holds all ``vocab`` columns. Counted as one buffer per
    bucket graph (an upper bound if the runtime shares them)."""
    return (len(buckets[0]) + len(buckets[1])) * batch * g.vocab * _FP32


# --------------------------------------------------------------------------- vision


@functools.lru_cache(maxsize=8)
def _vision_params_meta(config_json: str) -> int:
    import torch
    from transformers import AutoConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

    config = json.loads(config_json)
    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        modules = (Gemma4VisionModel(hf.vision_config), Gemma4MultimodalEmbedder(hf.vision_config, hf.text_config))
    return sum(math.prod(t.shape) for m in modules for t in m.state_dict().values())


def _has_weights(root: Path) -> bool:
    return (root / SINGLE_NAME).is_file() or (root / INDEX_NAME).is_file()


def vision_params(config: dict, src_dir: str | Path | None = None) -> tuple[int, str]:
    """Parameters of the vision tower plus ``embed_vision`` and where the count came from.

    From the safetensors headers when ``src_dir`` is a checkpoint directory with weights
    (``model.vision_tower.*`` and ``model.embed_vision.*``, no tensor data read), otherwise
    by building both modules from the config on the meta device (transformers 5.24, as
    ``save_pretrained`` would store them, persistent buffers included). 0 for a
    text-only config.
    """
    if config.get("model_type") != "gemma4" or not config.get("vision_config"):
        return 0, "no vision_config"
    if src_dir is not None:
        root = Path(src_dir)
        if _has_weights(root):
            ckpt = Checkpoint(root, source=True)
            n = sum(math.prod(info.shape) for name, info in ckpt.tensors.items()
                    if tower_of(name) in VISION_PREFIXES)
            return n, f"safetensors headers of {root}"
    return _vision_params_meta(json.dumps(config, sort_keys=True)), "the config, built on the meta device"


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was computed for (``gpu_mem_bytes`` in bytes; ``seq_len`` and
    ``max_num_batched_tokens`` in tokens; the latter None for a Neuron plan;
    ``enable_bucketing`` and ``max_context_length``, the longest prompt in tokens: NxDI's, Neuron
    plans only)."""

    model: str
    fmt: str
    tp: int
    target: str | None
    gpu_mem_bytes: int | None
    seq_len: int
    batch: int
    lm_head: str
    attention: str
    embedding: str
    max_num_batched_tokens: int | None = None
    enable_bucketing: bool = False
    gpu_memory_utilization: float | None = None
    max_context_length: int | None = None


GROUPS = ("experts", "lm_head", "dense_mlp", "attention", "norms_and_routers", "embedding", "vision")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per TP rank (ints) by group, the KV cache, and the verdicts.

    Attributes:
        inputs: the inputs of the plan.
        experts, lm_head, dense_mlp, attention, norms_and_routers, embedding, vision:
            device weight bytes on one rank (``embedding`` is the device part: 0 when the
            table stays on the host; ``lm_head`` is 0 when tied to the device embedding).
        weights_per_rank: the sum of those groups.
        kv_cache: bf16 KV cache bytes on one rank for ``batch`` sequences of ``seq_len``
            tokens, as the serving engine reserves it (:func:`kv_cache_vllm` on a GPU,
            :func:`kv_cache_nxdi` on Neuron); ``kv_cache_sliding + kv_cache_full``.
        kv_cache_sliding, kv_cache_full: its bytes on sliding-window and on full layers.
        logits_outputs: Neuron plans: the fp32 logits each compiled NxDI graph outputs on a rank
            (:func:`nxdi_logits_bytes`); 0 for a GPU plan.
        context_encoding_attention: Neuron plans: the attention scores of the largest
            context-encoding bucket (:func:`nxdi_context_attention_bytes`); 0 for a GPU plan.
        buckets: Neuron plans: NxDI's ``context_encoding`` and ``token_generation`` buckets
            (positions, :func:`nxdi_buckets`); None for a GPU plan.
        total_per_rank: ``weights_per_rank + kv_cache + logits_outputs + context_encoding_attention``.
        device_mem_per_rank: device memory of one rank (16 GiB per NeuronCore, or
            ``--gpu-mem`` times vLLM's ``--gpu-memory-utilization``); None without a target.
        margin: ``device_mem_per_rank - total_per_rank`` (negative: short); None without a target.
        fits: device verdict (``margin >= 0``); None without a target.
        longest_seq_len: the largest ``seq_len`` (tokens, at most the model's
            ``max_position_embeddings`` where the config gives it) at which ``total_per_rank`` still
            fits ``device_mem_per_rank`` at this ``batch`` and every other input unchanged (KV cache,
            logits outputs and, for prompts capped at ``max_context_length``, the context-encoding
            attention recomputed, :func:`longest_seq_len`); 0 when not even one token fits;
            None without a target.
        max_positions: the model's ``max_position_embeddings`` (tokens; None when the config has none).
        host_embedding: bytes of the bf16 embedding table kept in host RAM (0 on device).
        host_rank_files: bytes of all local ranks' weights. int8-neuron: its rank files, handed to
            the Neuron runtime's ``initialize`` memory-mapped (g4's ``load_weights``): page cache,
            read once and dropped by the kernel under pressure, so not part of the need. Another
            format on a Neuron target: sharded in host memory by NxDI's own load before
            ``initialize`` (aws-neuron/neuronx-distributed-inference ``models/application_base.py``),
            part of the need. 0 for a GPU.
        host_page_cache_kept: the part of those pages the load must keep resident
            (:data:`HOST_PAGE_CACHE_KEPT`, measured: none).
        host_anonymous: int8-neuron on Neuron: anonymous memory of the serving process's weight
            hand-over (:data:`HOST_LOAD_ANON_BYTES`, measured on the 26B-A4B at TP 2 and used as the
            figure for every int8-neuron plan: the embedded model's was 0.26 GiB); else 0.
        host_reserve: int8-neuron on Neuron: the OS, the Neuron runtime and the server beside it
            (:data:`HOST_RESERVE_BYTES`, an allowance); else 0.
        host_ram_need: int8-neuron: ``host_anonymous + host_page_cache_kept + host_reserve +
            host_embedding``; another format on Neuron: ``host_rank_files + host_embedding``.
        host_ram: the instance's RAM (Neuron targets); None when not known.
        host_margin, host_fits: the host verdict; None when not checked.
        layout: group -> how it is stored and split.
        notes: what is and is not counted.
    """

    inputs: PlanInputs
    experts: int
    lm_head: int
    dense_mlp: int
    attention: int
    norms_and_routers: int
    embedding: int
    vision: int
    weights_per_rank: int
    kv_cache: int
    kv_cache_sliding: int
    kv_cache_full: int
    logits_outputs: int
    context_encoding_attention: int
    buckets: dict[str, list[int]] | None
    total_per_rank: int
    device_mem_per_rank: int | None
    margin: int | None
    fits: bool | None
    longest_seq_len: int | None
    max_positions: int | None
    host_embedding: int
    host_rank_files: int
    host_page_cache_kept: int
    host_anonymous: int
    host_reserve: int
    host_ram_need: int
    host_ram: int | None
    host_margin: int | None
    host_fits: bool | None
    layout: dict[str, str]
    notes: tuple[str, ...]

    def groups(self) -> dict[str, int]:
        """Device weight bytes per rank, by group, in report order."""
        return {name: getattr(self, name) for name in GROUPS}

    def to_dict(self) -> dict:
        """The plan as plain JSON types; every byte figure an int."""
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        d["units"] = "bytes (GB = 10**9, GiB = 2**30)"
        return d

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """A text report: one aligned table for the device rank, one for the host, the verdicts."""
        p = self.inputs
        where = _describe_target(p)
        prompts = "" if p.max_context_length is None else f", prompts up to {p.max_context_length} tokens"
        lines = [f"memory plan: {p.model}, {p.fmt}, TP={p.tp}, {where}",
                 f"KV cache: bf16, {p.batch} x {p.seq_len} tokens{_batched(p)}{prompts}; lm_head {p.lm_head}, "
                 f"attention {p.attention}, embedding on the {p.embedding}", ""]
        rows = [(name, getattr(self, name), self.layout.get(name, "")) for name in GROUPS]
        rows += [("weights", self.weights_per_rank, ""), ("kv_cache", self.kv_cache, self.layout["kv_cache"]),
                 ("  sliding layers", self.kv_cache_sliding, self.layout["kv_cache_sliding"]),
                 ("  full layers", self.kv_cache_full, self.layout["kv_cache_full"])]
        if self.buckets is not None:
            rows.append(("logits outputs", self.logits_outputs, self.layout["logits_outputs"]))
            rows.append(("context encoding", self.context_encoding_attention, self.layout["context_encoding"]))
        rows.append(("total", self.total_per_rank, ""))
        if self.device_mem_per_rank is not None:
            what = ("one NeuronCore" if p.target
                    else f"vLLM's {p.gpu_memory_utilization:g} of one GPU (--gpu-memory-utilization)")
            rows += [("device memory", self.device_mem_per_rank, what),
                     ("margin", self.margin, _verdict(self.fits))]
        lines += _table("per rank (device)", rows)
        if self.host_ram_need or self.host_ram is not None:
            host = []
            if self.host_rank_files and p.fmt == INT8_NEURON:
                host += [("rank files", self.host_rank_files, f"{p.tp} local rank(s), memory-mapped: page cache, "
                          "read once by initialize, not counted"),
                         ("  page cache kept", self.host_page_cache_kept, "measured (bench/bench_inf2_deploy.py)"),
                         ("weight hand-over", self.host_anonymous, "anonymous memory, measured peak at 26B-A4B "
                          "TP 2 (bench/bench_inf2_deploy.py)"),
                         ("OS, runtime, server", self.host_reserve, "an allowance, not measured on inf2 (also "
                          "covers NxDI's load of the compiled graphs and warmup)")]
            elif self.host_rank_files:
                host += [("rank weights", self.host_rank_files, f"{p.tp} local rank(s), sharded in host memory "
                          "by NxDI's own load before initialize")]
            host += [("embedding table", self.host_embedding,
                      "bf16, looked up on the host" if self.host_embedding else ""),
                     ("need", self.host_ram_need, "")]
            if self.host_ram is not None:
                host += [("host RAM", self.host_ram, p.target or ""),
                         ("margin", self.host_margin, _verdict(self.host_fits))]
            lines += [""] + _table("host", host)
        lines.append("")
        if self.fits is not None:
            lines.append(f"device: {_verdict(self.fits)} ({_amount(self.margin)} per rank)")
        if self.longest_seq_len is not None:
            cap = self.longest_seq_len == self.max_positions
            lines.append(f"longest --seq-len that fits the device at --batch {p.batch}: "
                         + (f"{self.longest_seq_len} tokens" + (" (the model's max_position_embeddings)" if cap else "")
                            if self.longest_seq_len else "none"))
        if self.host_fits is not None:
            lines.append(f"host:   {_verdict(self.host_fits)} ({_amount(self.host_margin)})")
        lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


def longest_seq_len(device_total, device_mem: int, max_positions: int | None) -> int:
    """The largest sequence length ``n`` (tokens) with ``device_total(n) <= device_mem``, searched in
    ``[1, max_positions]`` (``2**24`` when the model states none) by bisection; 0 when ``n = 1``
    does not fit. ``device_total`` (bytes per rank for ``n`` tokens) must not decrease with ``n``,
    as weights plus KV cache plus logits outputs plus the attention of a prompt of
    ``min(max_context_length, n)`` do."""
    hi = max_positions or 2**24
    if device_total(1) > device_mem:
        return 0
    if device_total(hi) <= device_mem:
        return hi
    lo = 1  # fits; hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if device_total(mid) <= device_mem else (lo, mid)
    return lo


def _batched(p: PlanInputs) -> str:
    return "" if p.max_num_batched_tokens is None else f", vLLM --max-num-batched-tokens {p.max_num_batched_tokens}"


def _verdict(fits: bool | None) -> str:
    return "" if fits is None else "FITS" if fits else "DOES NOT FIT"


def _amount(margin: int) -> str:
    word, n = ("spare" if margin >= 0 else "short"), abs(margin)
    return f"{n / GB:.2f} GB = {n / GiB:.2f} GiB {word}" if n >= GB else f"{format_bytes(n)} {word}"


def _table(title: str, rows: list[tuple[str, int, str]]) -> list[str]:
    width = max(len(title), *(len(r[0]) + 2 for r in rows))
    out = [f"{title:<{width}} {'bytes':>16} {'GB':>9} {'GiB':>9}"]
    for name, n, how in rows:
        out.append(f"  {name:<{width - 2}} {n:>16,} {n / GB:>9.3f} {n / GiB:>9.3f}  {how}".rstrip())
    return out


def _describe_target(p: PlanInputs) -> str:
    if p.target:
        t = NEURON_TARGETS[p.target]
        return (f"{t.name} ({t.neuron_cores} NeuronCores x {t.hbm_per_core_bytes // GiB} GiB HBM, "
                f"{t.host_ram_bytes // GiB} GiB host RAM)")
    if p.gpu_mem_bytes:
        usable = p.gpu_mem_bytes * p.gpu_memory_utilization
        return (f"GPUs of {p.gpu_mem_bytes / GB:.2f} GB = {p.gpu_mem_bytes / GiB:.2f} GiB, one rank per GPU; "
                f"vLLM uses {p.gpu_memory_utilization:g} of it (--gpu-memory-utilization): {usable / GB:.2f} GB")
    return "no target (no fit check)"


def _with_defaults(fmt: str, neuron: bool, tied: bool, lm_head: str | None, attention: str | None,
                   embedding: str | None) -> tuple[str, str, str]:
    """(lm_head, attention, embedding) with the format's defaults filled in."""
    if fmt == INT8_NEURON:  # the rank files hold the device embedding shard g4's NxDI class uses
        return lm_head or "int8-sharded", attention or "bf16", embedding or "device"
    embedding = embedding or "device"
    shared = tied and not neuron and embedding == "device"
    return lm_head or ("tied" if shared else "bf16-sharded"), attention or _QUANT[fmt], embedding


def _check_target(fmt: str, target: str | None, gpu_mem_bytes: int | None, seq_len: int, batch: int) -> None:
    if fmt not in FORMATS:
        raise G4Error(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if target is not None and target not in NEURON_TARGETS:
        gpu = "" if fmt == INT8_NEURON else " (or --gpu-mem for a GPU)"
        raise G4Error(f"unknown target {target!r}; known: {', '.join(NEURON_TARGETS)}{gpu}")
    if target is not None and gpu_mem_bytes is not None:
        raise G4Error("give either a Neuron --target or --gpu-mem, not both")
    if gpu_mem_bytes is not None and gpu_mem_bytes <= 0:
        raise G4Error(f"GPU memory must be positive, got {gpu_mem_bytes}")
    if seq_len < 1 or batch < 1:
        raise G4Error(f"seq_len and batch must be >= 1, got {seq_len} and {batch}")
    if fmt == INT8_NEURON and gpu_mem_bytes is not None:
        raise G4Error("int8-neuron is the AWS Neuron format; use --target (or --format nvfp4|bf16 for a GPU)")
    if fmt == NVFP4 and target is not None:
        raise G4Error(f"NVFP4 cannot be served on {target}: NeuronCore-v2 has no FP4 compute "
                      "(aws-neuron-sdk about-neuron/arch/neuron-hardware/neuron-core-v2.rst); use --format int8-neuron")


def _check_options(fmt: str, neuron: bool, g: Architecture, lm_head: str, attention: str, embedding: str) -> None:
    for what, value, known in (("lm_head", lm_head, LM_HEADS), ("attention", attention, ATTENTIONS),
                               ("embedding", embedding, EMBEDDINGS)):
        if value not in known:
            raise G4Error(f"unknown {what} {value!r}; known: {', '.join(known)}")
    quant = _QUANT[fmt]
    if attention not in ("bf16", quant):
        raise G4Error(f"attention {attention} does not exist in the {fmt} format (use bf16 or {quant})")
    if lm_head == "int8-sharded" and fmt != INT8_NEURON:
        raise G4Error(f"an int8 lm_head exists only in the int8-neuron format, not {fmt}")
    if fmt == INT8_NEURON and embedding != "device":
        raise G4Error("embedding 'host' does not apply to int8-neuron: its rank files hold the embedding shard "
                      "g4's NxDI class looks tokens up in on the device (embed_tokens [V, H/T])")
    if lm_head == "tied" and not g.tied:
        raise G4Error("lm_head 'tied' needs tie_word_embeddings; this model has its own lm_head.weight")
    if lm_head == "tied" and (embedding != "device" or neuron or fmt == INT8_NEURON):
        raise G4Error("lm_head 'tied' shares the embedding table on a GPU; on Neuron or with a host "
                      "embedding the lm_head is its own copy (int8-sharded, bf16-sharded or bf16-replicated)")


def _check_tp(g: Architecture, tp: int, fmt: str, t: NeuronTarget | None) -> None:
    why = tp_refusal(g, tp, fmt=fmt)
    if why:
        raise G4Error(f"--tp {tp} cannot be mapped onto this model: {why}")
    if t is not None and tp > t.neuron_cores:
        enough = [name for name, other in NEURON_TARGETS.items() if other.neuron_cores >= tp]
        where = f"use --target {' or '.join(enough)}" if enough else "no known --target has that many"
        raise G4Error(f"--tp {tp} needs {tp} NeuronCores; {t.name} has {t.neuron_cores}: {where} "
                      "(--force overrides only the memory verdict, never the core count)")



def _layout(quant: str, lm_head: str, attention: str, embedding: str, vision: int, g: Architecture,
            batched_tokens: int | None, seq_len: int, buckets: dict | None, batch: int, tp: int) -> dict[str, str]:
    """How each group is stored and split, for the report."""
    name = "int8 + fp32 per-channel scales" if quant == "int8" else quant
    experts = ("int8, expert-wise fp32 scales [E,1,out]; gate_up column- (scale split), down row-parallel "
               "(scale replicated)" if quant == "int8" else f"{name}; gate_up column-, down row-parallel")
    return {
        "experts": experts,
        "lm_head": {"int8-sharded": "int8 + fp32 scale, vocab rows split", "bf16-sharded": "bf16, vocab rows split",
                    "bf16-replicated": "bf16, whole on every rank",
                    "tied": "tied to the embedding table (counted there)"}[lm_head],
        "dense_mlp": f"{name}; gate/up column-, down row-parallel",
        "attention": f"{'int8 + fp32 per-channel scales' if attention == 'int8' else attention}; heads split, "
                     "o_proj row-parallel",
        "norms_and_routers": "bf16, replicated",
        "embedding": ("bf16, hidden columns split (NxD ParallelEmbedding)" if quant == "int8" else
                      "bf16, vocab-sharded") if embedding == "device" else "on the host (not on the device)",
        "vision": "bf16, whole on every rank" if vision else "not loaded",
        **_kv_layout(g, batched_tokens, seq_len),
        **({} if buckets is None else {"logits_outputs": (
            f"fp32 [{batch}, 1, {g.vocab}] per graph: context encoding buckets {buckets['context_encoding']}, "
            f"token generation buckets {buckets['token_generation']}"),
            "context_encoding": (f"attention of the largest context-encoding bucket ({buckets['context_encoding'][-1]} "
                                 f"tokens, the longest prompt): fp32 scores + bf16 probabilities "
                                 f"[{g.heads // tp}, S, S], one layer at a time")}),
    }


def _kv_layout(g: Architecture, batched_tokens: int | None, seq_len: int) -> dict[str, str]:
    """How the KV cache was sized: which engine's rule, in words, for the report."""
    if batched_tokens is None:
        ring = next((n for a, n in zip(g.layers, kv_cache_positions(g.layers, seq_len, g.sliding_window))
                     if a.sliding), 0)
        return {"kv_cache": "bf16 K and V as g4's NxDI class allocates them (kv_cache_positions in core/gemma4.py)",
                "kv_cache_sliding": f"min(window {g.sliding_window} - 1, {seq_len}) = {ring} tokens, a ring",
                "kv_cache_full": f"{seq_len} tokens"}
    tokens = min(g.sliding_window - 1 + batched_tokens, seq_len)
    return {"kv_cache": "bf16 K and V; vLLM's rule (SlidingWindowSpec / FullAttentionSpec)",
            "kv_cache_sliding": f"min(window {g.sliding_window} - 1 + {batched_tokens} batched, {seq_len}) = "
                                f"{tokens} tokens in blocks, + 1 block",
            "kv_cache_full": f"{seq_len} tokens in blocks"}


def _notes(g: Architecture, tp: int, t: NeuronTarget | None, neuron: bool, seq_len: int, fmt: str) -> list[str]:
    notes = []
    if g.max_positions and seq_len > g.max_positions:
        notes.append(f"seq_len {seq_len} is longer than the model's max_position_embeddings {g.max_positions}")
    if t is not None:
        if tp not in t.tp_degrees:
            notes.append(f"NxDI documents TP degrees {', '.join(map(str, t.tp_degrees))} for {t.name.split('.')[0]}; "
                         f"{tp} is not one of them")
        notes.append("host RAM (int8-neuron): g4's load_weights hands the rank files to the Neuron runtime's "
                     "initialize memory-mapped; with a stand-in initialize that reads each byte once, the hand-over "
                     "of the real 26B-A4B at TP 2 completes in a 4 GiB memory cgroup (bench/bench_inf2_deploy.py); "
                     "the 2 GiB for the OS, the runtime (its own copy, NxDI's graph load and warmup) and the server "
                     "is an allowance")
        notes.append("not counted: the compile (g4serve compile, NxDI's trace and neuronx-cc), which runs apart "
                     "from serving on any x86 box with the Neuron SDK; its host memory is not measured here (the "
                     "trace needs the SDK)")
        notes.append("inf2/trn1 need Neuron SDK 2.28 (NxDI 0.8); later NxDI supports only Trn2 and newer")
    replicated = [layer for layer in g.layers if layer.kv_heads < tp]
    if replicated:
        heads = "/".join(map(str, sorted({layer.kv_heads for layer in replicated})))
        n = len(replicated)
        notes.append(f"KV heads replicated (one per rank) on {n} layer{'s' if n != 1 else ''} whose KV heads "
                     f"({heads}) are fewer than TP {tp}")
    if not neuron and tp > 1:
        notes.append("GPU ranks: experts split by TP (not expert parallel); the embedding is vocab-sharded")
    if neuron or fmt == INT8_NEURON:
        notes.append("counted per NxDI bucket graph: its fp32 logits output; of activations only the attention scores "
                     "of the largest context-encoding bucket (g4's class computes plain attention, S x S per head; "
                     "NxDI's flash-attention kernel is not used); not counted: the other activations and "
                     "scratchpad, compiled instructions, input tensors (ids, positions, masks), the runtime")
        notes.append("a prompt longer than the largest context-encoding bucket (max_context_length) is refused; "
                     "encoding it in chunks (NxDI's chunked prefill or windowed context encoding) is not implemented")
    else:
        notes.append("not counted: activations, compiler scratchpad / CUDA context and graphs, the runtime")
    return notes


def plan_memory(config: dict, *, fmt: str, tp: int = 1, target: str | None = None, gpu_mem_bytes: int | None = None,
                seq_len: int = 8192, batch: int = 1, lm_head: str | None = None, attention: str | None = None,
                embedding: str | None = None, src_dir: str | Path | None = None,
                model: str | None = None, max_num_batched_tokens: int | None = None,
                enable_bucketing: bool = False, gpu_memory_utilization: float | None = None,
                max_context_length: int | None = None) -> MemoryPlan:
    """Plan the memory of ``config`` served in ``fmt`` at TP degree ``tp``.

    Args:
        config: ``config.json`` of a Gemma 4 MoE model (multimodal or text-only, release
            or ``per_layer_config`` form).
        fmt: ``int8-neuron`` (int8 per-channel experts and dense MLP, NxD layout),
            ``nvfp4`` (modelopt NVFP4 experts, dense MLP and, by default, attention) or
            ``bf16``.
        tp: tensor-parallel degree; one rank per NeuronCore or per GPU.
        target: a Neuron instance in :data:`NEURON_TARGETS`, or None.
        gpu_mem_bytes: memory of one GPU in bytes (exclusive with ``target``), or None.
        seq_len, batch: KV cache size in tokens per sequence (vLLM's ``--max-model-len``)
            and sequences.
        lm_head: ``int8-sharded`` (vocab rows split; int8-neuron only), ``bf16-sharded``,
            ``bf16-replicated`` or ``tied`` (shares the device embedding table, as vLLM
            does; needs ``tie_word_embeddings`` and a device embedding). Default:
            ``int8-sharded`` for int8-neuron, else ``tied`` (``bf16-sharded`` on Neuron,
            with a host embedding or for untied models).
        attention: ``bf16``, ``int8`` (int8-neuron) or ``nvfp4`` (nvfp4). Default bf16,
            nvfp4 for the nvfp4 format (modelopt's default preset).
        embedding: ``host`` (bf16 table looked up on the host; only the lm_head is on the
            device) or ``device`` (bf16, vocab-sharded). Default host for int8-neuron.
        src_dir: checkpoint directory to read the vision tower's size from.
        model: a name for the report.
        max_num_batched_tokens: tokens vLLM schedules per step (``--max-num-batched-tokens``),
            which sets what its sliding layers reserve; default
            :func:`vllm_default_batched_tokens` of ``gpu_mem_bytes``. Only for GPU plans
            (nvfp4 or bf16 without a Neuron ``target``); Neuron plans use NxDI's rule.
        enable_bucketing: Neuron plans: NxDI's ``enable_bucketing`` (:func:`nxdi_buckets`), which
            sets how many graphs output logits; the KV cache does not depend on it.
        gpu_memory_utilization: GPU plans: the share (0, 1] of ``gpu_mem_bytes`` vLLM may use
            (``vllm serve --gpu-memory-utilization``); default
            :data:`VLLM_GPU_MEMORY_UTILIZATION`. The fit check is against that share.
        max_context_length: Neuron plans: the longest prompt in tokens, NxDI's
            ``max_context_length`` (the largest context-encoding bucket; its attention is counted,
            :func:`nxdi_context_attention_bytes`); default
            :func:`g4.exporters.neuron_int8.serving_max_context_length` of ``seq_len``, as
            ``g4convert int8-neuron`` writes it. For the longest ``seq_len`` it stays capped at
            this value.

    Returns:
        The :class:`MemoryPlan`. The vision tower and ``embed_vision`` are counted (bf16,
        whole on each rank) only for GPU serving of nvfp4/bf16 (or no target); Neuron
        plans are for text serving.

    Raises:
        G4Error: an unknown option, a combination that does not exist (NVFP4 on Neuron,
            int8 on a GPU, both a target and a GPU, ``max_num_batched_tokens`` for Neuron,
            ``max_context_length`` for a GPU or longer than ``seq_len``),
            a TP degree the model cannot be split over, more ranks than the target has cores,
            or a config the planner cannot read.
    """
    _check_target(fmt, target, gpu_mem_bytes, seq_len, batch)
    neuron = target is not None
    on_neuron = neuron or fmt == INT8_NEURON
    if max_num_batched_tokens is not None and on_neuron:
        raise G4Error("--max-num-batched-tokens is a vLLM (GPU) setting; a Neuron plan sizes the KV cache "
                      "by NxDI's rule")
    if enable_bucketing and not on_neuron:
        raise G4Error("--bucketing is an NxDI (Neuron) setting; a GPU plan sizes the KV cache by vLLM's rule")
    if max_context_length is not None and not on_neuron:
        raise G4Error("--max-context-length is an NxDI (Neuron) setting; vLLM encodes any prompt up to --seq-len")
    prompt = serving_max_context_length(max_context_length, seq_len) if on_neuron else None
    if gpu_memory_utilization is not None and on_neuron:
        raise G4Error("--gpu-memory-utilization is a vLLM (GPU) setting; a Neuron plan has none")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise G4Error(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    utilization = None if on_neuron else gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise G4Error(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}")
    batched = None if on_neuron else max_num_batched_tokens or vllm_default_batched_tokens(gpu_mem_bytes)
    t = NEURON_TARGETS[target] if neuron else None
    g = read_architecture(config)
    lm_head, attention, embedding = _with_defaults(fmt, neuron, g.tied, lm_head, attention, embedding)
    _check_options(fmt, neuron, g, lm_head, attention, embedding)
    _check_tp(g, tp, fmt, t)

    quant = _QUANT[fmt]
    table = g.vocab * g.hidden * _BF16
    notes: list[str] = []
    vision = 0
    if not neuron and fmt != INT8_NEURON:
        n, source = vision_params(config, src_dir)
        vision = n * _BF16
        if n:
            notes.append(f"vision tower + embed_vision: {n:,} parameters (from {source}), bf16, whole on every rank")
    elif config.get("vision_config"):
        notes.append("vision tower and embed_vision not counted: text-only serving")
    if config.get("audio_config"):
        notes.append("audio tower not counted")
    if fmt == INT8_NEURON:  # from the exporter's layout table: the bytes of the rank files
        groups = dict(neuron_int8_weight_bytes(config, tp, attention=attention, lm_head=lm_head), vision=vision)
    else:
        lm_bytes = {"bf16-sharded": _column("bf16", g.vocab // tp, g.hidden), "bf16-replicated": table,
                    "tied": 0}[lm_head]
        groups = dict(
            experts=_experts_bytes(g, quant, tp), lm_head=lm_bytes, dense_mlp=_dense_mlp_bytes(g, quant, tp),
            attention=_attention_bytes(g, attention, tp), norms_and_routers=_norms_and_routers_bytes(g),
            embedding=table // tp if embedding == "device" else 0, vision=vision)
    weights = sum(groups.values())

    def sequence_bytes(n: int) -> tuple[KvCache, dict[str, list[int]] | None, int, int]:
        """KV cache, buckets, logits outputs and context-encoding attention for sequences of ``n``
        tokens (prompts of at most ``min(prompt, n)``)."""
        if on_neuron:
            cte, tkg = nxdi_buckets(n, enable_bucketing=enable_bucketing, max_context_length=min(prompt, n))
            return (kv_cache_nxdi(g, tp, n, batch), {"context_encoding": cte, "token_generation": tkg},
                    nxdi_logits_bytes(g, batch, (cte, tkg)), nxdi_context_attention_bytes(g, tp, cte[-1]))
        return kv_cache_vllm(g, tp, n, batch, batched), None, 0, 0

    kv_parts, buckets, logits, cte_attention = sequence_bytes(seq_len)
    kv = kv_parts.total
    total = weights + kv + logits + cte_attention
    device = t.hbm_per_core_bytes if t else None if gpu_mem_bytes is None else int(gpu_mem_bytes * utilization)
    margin = None if device is None else device - total

    def device_total(n: int) -> int:
        kv_n, _, logits_n, attention_n = sequence_bytes(n)
        return weights + kv_n.total + logits_n + attention_n

    longest = None if device is None else longest_seq_len(device_total, device, g.max_positions)
    host_embedding = table if embedding == "host" else 0
    host_files = tp * weights if t else 0
    # int8-neuron: g4's pre-sharded rank files, memory-mapped (measured rule, HOST_LOAD_ANON_BYTES);
    # another format on Neuron goes through NxDI's own load, which shards the checkpoint in host
    # memory before initialize: every rank's weights counted, as before the measurement
    mapped = t is not None and fmt == INT8_NEURON
    host_load = (HOST_PAGE_CACHE_KEPT, HOST_LOAD_ANON_BYTES, HOST_RESERVE_BYTES) if mapped else (0, 0, 0)
    host_need = sum(host_load) + host_embedding + (0 if mapped else host_files)
    host_ram = t.host_ram_bytes if t else None
    host_margin = None if host_ram is None else host_ram - host_need
    return MemoryPlan(
        inputs=PlanInputs(model or "model", fmt, tp, target, gpu_mem_bytes, seq_len, batch, lm_head, attention,
                          embedding, batched, enable_bucketing, utilization, prompt),
        **groups, weights_per_rank=weights, kv_cache=kv, kv_cache_sliding=kv_parts.sliding,
        kv_cache_full=kv_parts.full, logits_outputs=logits, context_encoding_attention=cte_attention,
        buckets=buckets, total_per_rank=total,
        device_mem_per_rank=device,
        margin=margin, fits=None if margin is None else margin >= 0, longest_seq_len=longest,
        max_positions=g.max_positions,
        host_embedding=host_embedding,
        host_rank_files=host_files, host_page_cache_kept=host_load[0], host_anonymous=host_load[1],
        host_reserve=host_load[2], host_ram_need=host_need, host_ram=host_ram,
        host_margin=host_margin, host_fits=None if host_margin is None else host_margin >= 0,
        layout=_layout(quant, lm_head, attention, embedding, vision, g, batched, seq_len, buckets, batch, tp),
        notes=tuple(notes + _notes(g, tp, t, neuron, seq_len, fmt)))


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class ResultShape:
    """What a g4 result (NVFP4 or int8-neuron) already fixes of its own plan.

    Attributes:
        detail: the result as :func:`g4.exporters.formats.detect_format` names it, e.g.
            ``"NVFP4 W4A16 (modelopt)"``.
        fixed: plan option -> the value the result's files fix (``fmt``; ``attention``; for
            int8-neuron ``tp``, ``seq_len`` and ``max_context_length``, which its rank files and
            manifest were written for); another value is refused (:func:`apply_result_shape`).
        defaults: plan option -> the default taken from the result where none is given
            (int8-neuron: the ``target`` it was converted for, ``bucketing`` as g4serve compiles it).
        unmodelled: why the plan cannot cost this result (NVFP4 ``--preset experts-only``:
            the dense MLP kept bf16), or None.
    """

    detail: str
    fixed: dict
    defaults: dict
    unmodelled: str | None = None


def result_shape(directory: Path) -> ResultShape | None:
    """The :class:`ResultShape` of ``directory`` when it holds an NVFP4 or int8-neuron result
    (from its own files: which linears are stored as E2M1 codes, the int8-neuron manifest and
    ``g4_conversion.json``), else None (a source checkpoint, or no checkpoint at all).

    Raises:
        CheckpointError: an int8-neuron manifest that cannot be read.
    """

    try:
        fmt = detect_format(directory)
    except CheckpointError:
        return None
    if fmt.format == INT8_NEURON:
        m = Manifest.from_dir(directory)
        facts = directory / FACTS_FILE
        target = None
        if facts.is_file():
            target = (read_json_object(facts, error=G4Error).get("options") or {}).get("target")
        fixed = {"fmt": INT8_NEURON, "tp": m.tp_degree, "attention": "int8" if m.quantize_attention else "bf16"}
        if m.max_length:
            fixed["seq_len"] = m.max_length
            fixed["max_context_length"] = m.max_context_length or m.max_length
        return ResultShape(fmt.detail, fixed, {"target": target if target in NEURON_TARGETS else None,
                                               "bucketing": True})
    if fmt.format != NVFP4:
        return None

    try:
        tensors = Checkpoint(directory).tensors
    except CheckpointError:  # not a complete result: refused as a source, with the converters' message
        return None
    codes = [name for name, info in tensors.items() if info.dtype == torch.uint8]
    attention = "nvfp4" if any(".self_attn." in name for name in codes) else "bf16"
    dense = any(".mlp." in name for name in codes)
    return ResultShape(fmt.detail, {"fmt": NVFP4, "attention": attention}, {},
                       None if dense else "its dense MLP is kept bf16 (--preset experts-only), which the plan's "
                                          "nvfp4 format does not model")


_OPTION_NAMES = {"fmt": "--format", "tp": "--tp", "seq_len": "--seq-len", "attention": "--attention",
                 "target": "--target", "bucketing": "--bucketing", "max_context_length": "--max-context-length"}


def apply_result_shape(src: str, shape: ResultShape, options: dict, given: set[str]) -> dict:
    """``options`` (plan option -> value) with what the result ``shape`` fixes and defaults
    filled in; ``given``: the options the user passed.

    Raises:
        G4Error: a given option that contradicts the result (naming the value to pass, or to
            leave the option out), or a result the plan cannot cost.
    """
    if shape.unmodelled:
        raise G4Error(f"{src}: {a_or_an(shape.detail)} result; {shape.unmodelled}: plan its source with "
                      "--format nvfp4 for the default preset's figures")
    options = dict(options)
    for key, value in shape.fixed.items():
        if key in given and options[key] != value:
            flag = _OPTION_NAMES[key]
            why = {"fmt": "", "tp": ": its rank files are one per TP rank",
                   "seq_len": ": g4serve compiles it for the length it was converted for",
                   "max_context_length": ": g4serve compiles it for the prompt length it was converted for",
                   "attention": ": its attention is stored that way"}[key]
            raise G4Error(f"{src}: {a_or_an(shape.detail)} result, planned as it is{why}; pass {flag} {value} "
                          f"(or leave {flag} out), or plan the source it was converted from")
        options[key] = value
    for key, value in shape.defaults.items():
        if key not in given:
            options[key] = value
    return options


def load_source(src: str) -> tuple[str, dict, Path | None, ResultShape | None]:
    """Resolve SRC_OR_CONFIG to ``(name, config, checkpoint directory or None, result shape or None)``.

    ``src`` is a checkpoint directory (its ``config.json``), a ``config.json`` path, a
    known model name (``gemma-4-26B-A4B``: the release config in ``convert/synth.py``; an
    existing path of that name wins), ``embedded`` (the package's tiny model) or a Hub repo
    id ``owner/name[@revision]`` (only its ``config.json`` is downloaded, see
    :func:`g4.convert.resolve.resolve_source`). A directory holding weights is opened as a
    conversion source first (headers only), so ``plan`` refuses what ``nvfp4`` and
    ``int8-neuron`` refuse, except a g4 result (NVFP4 or int8-neuron): that is planned as the
    result it is, from its config (:func:`result_shape`; the directory returned is then None,
    as the result's headers are not a source's).

    Raises:
        G4Error: none of those, unreadable JSON, a repo id that cannot be resolved, or an
            already quantized checkpoint that is not a g4 result (the message names the
            config.json to pass instead).
        CheckpointError: a directory with weights that the converters would refuse (shard
            named outside it, a tensor not BF16/F16/F32, corrupt shards).
    """
    if src in KNOWN_MODELS and not Path(src).exists():
        return src, PRESETS[src], None, None
    path = resolve_source(src, config_only=True)
    directory = path if path.is_dir() else None
    file = path / CONFIG_NAME if directory else path
    if not file.is_file():
        raise G4Error(f"{src}: not a checkpoint directory, a config.json file or a known model "
                      f"({', '.join(KNOWN_MODELS)}, {EMBEDDED}), nor a Hub repo id owner/name[@revision]")
    config = read_json_object(file, error=G4Error)
    name = src if src == EMBEDDED else source_name(src) if directory else file.name
    shape = result_shape(directory) if directory else None
    if shape is not None:
        return name, config, None, shape
    if directory and _has_weights(directory):
        why = quantized_reason(directory, config)
        if why:
            raise G4Error(f"{why}: the checkpoint is already quantized and not a complete g4 result; plan reads only "
                          f"the config: pass {file} to plan the model it describes")
        Checkpoint(directory, source=True)
    return name, config, directory, None
