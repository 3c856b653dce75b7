"""Builders for tiny Gemma 4 MoE checkpoints made with transformers' own classes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

from g4.convert.embedded_model import EMBEDDED_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def text_config(**overrides) -> Gemma4TextConfig:
    """A 2-layer text config: layer 0 sliding, layer 1 full attention with k_eq_v (no v_proj)."""
    kw = dict(
        vocab_size=1024, hidden_size=64, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=96, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, sliding_window=16, final_logit_softcapping=30.0, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    kw.update(overrides)
    return Gemma4TextConfig(**kw)


def build(out: Path, *, multimodal: bool = True, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """Save a random tiny Gemma 4 MoE (bf16) to ``out`` with the embedded model's tokenizer files."""
    torch.manual_seed(seed)
    tc = text_config(**overrides)
    if multimodal:
        vc = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                                position_embedding_size=64, standardize=True)
        config = Gemma4Config(text_config=tc, vision_config=vc, audio_config=None, image_token_id=1000,
                              boi_token_id=1001, eoi_token_id=1002, video_token_id=1003, audio_token_id=1004,
                              boa_token_id=1005, eoa_token_id=1006, eoa_token_index=1006, tie_word_embeddings=True)
        model = Gemma4ForConditionalGeneration(config)
    else:
        model = Gemma4ForCausalLM(tc)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    if tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copy2(EMBEDDED_DIR / name, out / name)
    return out


def tensor_names(path: Path) -> dict[str, tuple]:
    from g4.convert.checkpoint import Checkpoint

    return {n: (i.dtype, i.shape) for n, i in Checkpoint(path).tensors.items()}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
