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
    from g4.core.checkpoint import Checkpoint

    return {n: (i.dtype, i.shape) for n, i in Checkpoint(path).tensors.items()}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def build_with_geometry_of(out: Path, like: dict, *, seed: int = 0, **overrides) -> Path:
    """Save a random text-only Gemma 4 MoE (``Gemma4ForCausalLM``, fp32, no tokenizer) whose attention
    geometry is ``like``'s (a release-form config such as ``g4.convert.synth.GEMMA4_26B_A4B``: query
    heads, head_dim / global_head_dim, KV heads / global KV heads, ``attention_k_eq_v``, RoPE
    parameters, softcap) with ``overrides`` applied to its text config (to shrink width, layers,
    experts and vocabulary). ``config.json`` is written back in the release form
    (``g4.core.gemma4.release_config``), as checkpoints ship.

    Weights are transformers' seeded initialisation, made non-degenerate: embedding rows ~ N(0, 0.3^2)
    (tied lm_head: logits of about 10-20, below the softcap of 30 where tanh would flatten
    differences); ``layer_scalar`` of layer ``L`` = ``0.5 + 0.3 L`` (transformers initialises them to
    1); the router's ``per_expert_scale`` and ``scale`` U(0.5, 1.5) (initialised to ones, which would
    leave a dropped or misplaced scale unseen); q_norm / k_norm weights ``d^-0.25`` times U(0.5, 1.5), so that the scale-1.0 attention scores
    are O(1) rather than O(sqrt(d)) and RoPE moves the attention pattern; post_attention /
    post_feedforward norm weights 20 times U(0.5, 1.5), so that the layers outweigh the scaled
    embedding in the residual (else the tied head's top id is the input id and greedy repeats it)."""
    from g4.core.gemma4 import release_config, text_config_of
    from g4.convert.synth import synthetic_config

    tc = synthetic_config(like, layers=overrides.pop("num_hidden_layers", None), vision=False)
    tc.update(overrides)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{k: v for k, v in tc.items() if k != "architectures"}))
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.randn(model.model.embed_tokens.weight.shape, generator=gen) * 0.3)
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.3 * i)
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                d = norm.weight.numel()
                norm.weight.copy_((0.5 + torch.rand(d, generator=gen)) * d ** -0.25)
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.copy_(20.0 * (0.5 + torch.rand(norm.weight.numel(), generator=gen)))
            for scale in (layer.router.per_expert_scale, layer.router.scale):
                scale.copy_(0.5 + torch.rand(scale.numel(), generator=gen))
    model.save_pretrained(out)
    path = Path(out) / "config.json"
    config = release_config(json.loads(path.read_text()))
    assert text_config_of(config).get("global_head_dim") == tc["global_head_dim"], "release form lost"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return Path(out)
