"""Synthetic checkpoints with a real Gemma 4 model's key names, shapes and dtypes.

Tensor names and shapes come from transformers' own ``Gemma4ForConditionalGeneration``
(or ``Gemma4ForCausalLM``) built on the meta device from the release config, so they are
exactly what ``save_pretrained`` writes; values are random bf16. Used for benchmarks and
dry runs of the converters on real shapes without downloading weights.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from g4.convert.resolve import EMBEDDED_DIR
from g4.core.checkpoint import CONFIG_NAME
from g4.core.errors import G4Error
from g4.core.gemma4 import LM_HEAD, MULTIMODAL_PREFIX, TEXT_PREFIX, read_architecture
from g4.core.progress import progress_bar
from g4.core.sizes import parse_size
from g4.exporters.output_dir import SYNTH_MARKER, atomic_output_dir
from g4.exporters.safetensors_writer import ShardedSafetensorsWriter, TensorSpec

_LAYER_PATTERN = ["sliding_attention"] * 5 + ["full_attention"]

# Release-format config.json of google/gemma-4-26B-A4B-it (the Hub's config.json; its
# safetensors index gives 25,805,936,206 stored parameters).
GEMMA4_26B_A4B: dict = {
    "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "dtype": "bfloat16",
    "audio_config": None, "tie_word_embeddings": True, "initializer_range": 0.02,
    "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880, "video_token_id": 258884,
    "boa_token_id": 256000, "eoa_token_id": 258883, "eoa_token_index": 258883, "audio_token_id": 258881,
    "eos_token_id": [1, 106], "vision_soft_tokens_per_image": 280,
    "text_config": {
        "model_type": "gemma4_text", "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "dtype": "bfloat16", "enable_moe_block": True,
        "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2816, "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02, "intermediate_size": 2112, "layer_types": _LAYER_PATTERN * 5,
        "max_position_embeddings": 262144, "moe_intermediate_size": 704, "num_attention_heads": 16,
        "num_experts": 128, "num_global_key_value_heads": 2, "num_hidden_layers": 30, "num_key_value_heads": 8,
        "num_kv_shared_layers": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": 8,
        "use_bidirectional_attention": "vision", "use_cache": True, "use_double_wide_mlp": False,
        "vocab_size": 262144, "vocab_size_per_layer_input": 262144},
    "vision_config": {
        "model_type": "gemma4_vision", "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 72, "patch_size": 16,
        "pooling_kernel_size": 3, "position_embedding_size": 10240,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}, "standardize": True,
        "use_clipped_linears": False, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
        "default_output_length": 280},
}
PRESETS = {"gemma-4-26B-A4B": GEMMA4_26B_A4B}
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def synthetic_config(like: str | dict, *, layers: int | None = None, vision: bool = True) -> dict:
    """Release-format config of ``like`` cut to ``layers`` decoder layers.

    The first ``layers - 1`` layers keep the real sliding/full pattern and the last is
    full attention (transformers forces the last layer to full attention).

    Raises:
        G4Error: unknown preset name or more layers than the model has.
    """
    if isinstance(like, str):
        if like not in PRESETS:
            raise G4Error(f"unknown model {like!r}; known: {', '.join(PRESETS)}")
        like = PRESETS[like]
    config = copy.deepcopy(like)
    text = config["text_config"]
    n = text["num_hidden_layers"] if layers is None else layers
    if not 1 <= n <= text["num_hidden_layers"]:
        raise G4Error(f"--layers {n}: the model has {text['num_hidden_layers']} layers")
    text["num_hidden_layers"] = n
    text["layer_types"] = text["layer_types"][: n - 1] + ["full_attention"]
    if not vision:
        text["architectures"] = ["Gemma4ForCausalLM"]
        return text
    return config


def synthetic_specs(config: dict) -> list[TensorSpec]:
    """Stored tensors (name, bf16, shape) of a model built from ``config`` on the meta device,
    as ``save_pretrained`` writes them (persistent buffers included, tied lm_head dropped)."""
    from transformers import AutoConfig, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    arch = read_architecture(config)
    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    cls = Gemma4ForConditionalGeneration if arch.multimodal else Gemma4ForCausalLM
    with torch.device("meta"):
        model = cls(hf)
    specs = [TensorSpec(name, torch.bfloat16, tuple(t.shape)) for name, t in model.state_dict().items()
             if not (arch.tied and name == LM_HEAD)]
    prefix = _lm_prefix(arch)
    shapes = {s.name: s.shape for s in specs}
    for L in range(arch.num_layers):  # transformers' model and g4's inventory of it agree
        for suffix, shape in arch.layer_tensor_shapes(L).items():
            assert shapes[f"{prefix}layers.{L}.{suffix}"] == shape, (L, suffix)
    return specs


def _lm_prefix(arch) -> str:
    """Key prefix of the language model in the layout transformers saves for ``arch``."""
    return MULTIMODAL_PREFIX if arch.multimodal else TEXT_PREFIX


def _random_tensor(spec: TensorSpec, gen: torch.Generator, *, ones: bool = False) -> torch.Tensor:
    if ones:  # layer_scalar: the identity, as transformers initialises it
        return torch.ones(spec.shape, dtype=spec.dtype)
    t = torch.randn(spec.shape, generator=gen, dtype=torch.bfloat16)
    if len(spec.shape) == 1:  # norms and scales: around 1
        return t.mul_(0.02).add_(1.0)
    return t.mul_(0.02)


def write_synthetic(out: str | Path, *, like: str | dict = "gemma-4-26B-A4B", layers: int = 2, vision: bool = True,
                    seed: int = 0, max_shard_size: str | int = "5GB", overwrite: bool = False,
                    progress: bool = True) -> Path:
    """Write a synthetic checkpoint (random bf16 weights, real names and shapes) to ``out``.

    Also writes ``config.json`` (release format) and, so that calibration has a
    tokenizer, the embedded tiny model's tokenizer, chat template and generation config.
    Host RAM: one tensor at a time (the largest is ``embed_tokens``, 1.48 GB for 26B-A4B).

    Returns:
        ``out`` as a Path.

    Raises:
        G4Error: unknown preset, bad layer count, or ``out`` exists without ``overwrite``.
    """
    config = synthetic_config(like, layers=layers, vision=vision)
    specs = synthetic_specs(config)
    arch = read_architecture(config)
    scalars = {f"{_lm_prefix(arch)}layers.{L}.layer_scalar" for L in range(arch.num_layers)}
    gen = torch.Generator().manual_seed(seed)
    out = Path(out)
    with atomic_output_dir(out, overwrite=overwrite, need_bytes=sum(spec.nbytes for spec in specs)) as tmp:
        marker = {"converter": {"name": "g4"}, "format": "g4-synthetic", "layers": layers, "seed": seed}
        (tmp / SYNTH_MARKER).write_text(json.dumps(marker) + "\n")
        writer = ShardedSafetensorsWriter(tmp, specs, max_shard_bytes=parse_size(max_shard_size))
        with progress_bar(writer.total_bytes, "synth", enabled=progress) as bar:
            for spec in specs:
                writer.write(spec.name, _random_tensor(spec, gen, ones=spec.name in scalars))
                bar.update(spec.nbytes)
        writer.close()
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        for name in _SIDE_FILES:
            shutil.copy2(EMBEDDED_DIR / name, tmp / name)
    return out
