"""Synthetic checkpoints: real 26B-A4B names/shapes from transformers on the meta device."""

import math

import torch

from g4.core.checkpoint import Checkpoint
from g4.convert.int8_neuron import convert_int8_neuron
from g4.convert.nvfp4 import convert_nvfp4
from g4.convert.synth import synthetic_config, synthetic_specs, write_synthetic


def test_full_26b_a4b_inventory_matches_the_published_count():
    specs = {s.name: s.shape for s in synthetic_specs(synthetic_config("gemma-4-26B-A4B"))}
    assert len(specs) == 1013
    assert sum(math.prod(s) for s in specs.values()) == 25_805_936_206  # HF API safetensors.total
    p = "model.language_model.layers"
    assert specs[f"{p}.0.experts.gate_up_proj"] == (128, 1408, 2816)
    assert specs[f"{p}.0.experts.down_proj"] == (128, 2816, 704)
    assert specs[f"{p}.5.self_attn.q_proj.weight"] == (8192, 2816)
    assert f"{p}.5.self_attn.v_proj.weight" not in specs and specs[f"{p}.4.self_attn.v_proj.weight"] == (2048, 2816)
    assert specs["model.language_model.embed_tokens.weight"] == (262144, 2816) and "lm_head.weight" not in specs


def test_cut_config_ends_in_full_attention():
    cfg = synthetic_config("gemma-4-26B-A4B", layers=3)
    assert cfg["text_config"]["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert synthetic_config("gemma-4-26B-A4B", layers=2, vision=False)["model_type"] == "gemma4_text"


def test_write_small_synthetic_and_convert_it(tmp_path):
    """Same code path as the 26B synth, on a config small enough for a unit test."""
    like = synthetic_config("gemma-4-26B-A4B", layers=2)
    tc = like["text_config"]
    tc.update(hidden_size=64, intermediate_size=32, moe_intermediate_size=16, num_experts=4, top_k_experts=2,
              vocab_size=1024, head_dim=32, global_head_dim=64, num_attention_heads=2, num_key_value_heads=1,
              num_global_key_value_heads=1)
    like["vision_config"].update(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=16, position_embedding_size=16)
    for k in ("boi_token_id", "eoi_token_id", "image_token_id", "video_token_id", "boa_token_id", "eoa_token_id",
              "eoa_token_index", "audio_token_id"):
        like[k] = 1000
    src = write_synthetic(tmp_path / "synth", like=like, layers=2, max_shard_size="30KB", progress=False)
    ck = Checkpoint(src)
    assert len({i.file for i in ck.tensors.values()}) > 1
    assert all(i.dtype == torch.bfloat16 for i in ck.tensors.values())
    report = convert_nvfp4(src, tmp_path / "out", calib_samples=2, calib_seq_len=32, progress=False)
    # the card of a conversion of random weights says so (a fresh-user finding: it did not)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "**Synthetic source, random weights: not a usable model.**" in card and "(2 layers, seed 0)" in card
    convert_int8_neuron(src, tmp_path / "int8", tp=1, progress=False)
    assert "**Synthetic source, random weights" in (tmp_path / "int8" / "README.md").read_text()
    # experts (2 layers x 4 x 3) + dense mlp (2 x 3) + q,k,v,o (sliding) + q,k,o (full, k_eq_v)
    assert report.linears_quantized == 2 * 4 * 3 + 2 * 3 + 4 + 3
