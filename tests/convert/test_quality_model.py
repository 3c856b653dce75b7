"""bench/quality_model.py: a short build has every Gemma 4 quirk the quality figures rely on, loads
with transformers, converts to NVFP4, and its cache stamp reuses or rebuilds as it should."""

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, Gemma4ForConditionalGeneration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import quality_model as qm  # noqa: E402
from g4.convert.embedded_model import CONTROL_TOKENS  # noqa: E402
from g4.core.errors import G4Error  # noqa: E402

LAYERS = "model.language_model.layers"
QUICK = dataclasses.replace(qm.Settings(), steps=2, eval_tokens=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("qm") / "quality-model"
    path, stamp, was_built = qm.ensure_quality_model(out, QUICK)
    assert was_built and path == out
    return out, stamp


@pytest.fixture(scope="module")
def tensors(built):
    with safe_open(built[0] / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_config_has_the_26b_quirks(built):
    text = json.loads((built[0] / "config.json").read_text())["text_config"]
    assert "per_layer_config" not in text and text["global_head_dim"] > text["head_dim"]  # release form
    assert text["attention_k_eq_v"] and text["enable_moe_block"] and text["tie_word_embeddings"]
    kinds = text["layer_types"]
    assert "full_attention" in kinds and kinds.count("sliding_attention") >= 4
    assert text["sliding_window"] < QUICK.ctx  # the eval windows run past the sliding window
    assert text["num_experts"] >= 16 and 2 <= text["top_k_experts"] < text["num_experts"]
    assert text["intermediate_size"] > 0 and text["moe_intermediate_size"] > 0
    assert text["vocab_size"] == QUICK.vocab_size and text["final_logit_softcapping"] == 30.0


def test_weights_have_the_26b_quirks(built, tensors):
    text = json.loads((built[0] / "config.json").read_text())["text_config"]
    full = text["layer_types"].index("full_attention")
    sliding = text["layer_types"].index("sliding_attention")
    assert f"{LAYERS}.{full}.self_attn.k_proj.weight" in tensors
    assert f"{LAYERS}.{full}.self_attn.v_proj.weight" not in tensors  # k_eq_v: V from k_proj
    assert f"{LAYERS}.{sliding}.self_attn.v_proj.weight" in tensors
    assert "lm_head.weight" not in tensors  # tied
    E, H, inter = text["num_experts"], text["hidden_size"], text["moe_intermediate_size"]
    for L in range(text["num_hidden_layers"]):
        assert tensors[f"{LAYERS}.{L}.experts.gate_up_proj"].shape == (E, 2 * inter, H)
        assert tensors[f"{LAYERS}.{L}.experts.down_proj"].shape == (E, H, inter)
        assert tensors[f"{LAYERS}.{L}.mlp.down_proj.weight"].shape == (H, text["intermediate_size"])
        assert tensors[f"{LAYERS}.{L}.router.per_expert_scale"].shape == (E,)
        scalar = tensors[f"{LAYERS}.{L}.layer_scalar"]
        assert scalar.shape == (1,) and abs(scalar.item() - 1) > 0.1  # trained from 0.7, not the identity
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    # Every quantized linear's input dimension takes NVFP4 blocks of 16 (the conversion below checks all).
    assert all(t.shape[-1] % 16 == 0 for k, t in tensors.items() if k.endswith(("_proj.weight", "_proj")))


def test_loads_with_transformers_and_tokenizer_layout(built):
    out, stamp = built
    model = Gemma4ForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16)
    layer = model.model.language_model.layers[0]
    assert "layer_scalar" in layer._buffers and abs(layer.layer_scalar.item() - 1) > 0.1
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == QUICK.vocab_size
    assert {i: tokenizer.convert_ids_to_tokens(i) for i in CONTROL_TOKENS} == CONTROL_TOKENS
    assert stamp["heldout_tokens"] == QUICK.eval_tokens and stamp["heldout_ppl"] > 1
    # The stated figure is the teacher-forced PPL of the saved model on the eval text.
    docs = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in qm.read_documents(qm.EVAL_TEXT)]
    ppl, n = qm.perplexity(model.float(), docs, QUICK.ctx, QUICK.eval_tokens)
    assert n == QUICK.eval_tokens and ppl == pytest.approx(stamp["heldout_ppl"], abs=1e-3)


def test_converts_to_nvfp4_weight_only(built, tmp_path):
    from g4.convert.nvfp4 import convert_nvfp4
    from g4.exporters.formats import check_result

    out = tmp_path / "nvfp4"
    report = convert_nvfp4(built[0], out, weight_only=True, progress=False)
    check_result(out)
    keys = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            keys |= set(f.keys())
    assert f"{LAYERS}.0.experts.15.down_proj.weight_scale" in keys
    assert report.layers == json.loads((built[0] / "config.json").read_text())["text_config"]["num_hidden_layers"]


def test_windows_cover_every_token():
    docs = [list(range(10, 20)), list(range(30, 33))]
    assert qm.windows(docs, ctx=5) == [[2, 10, 11, 12, 13], [2, 14, 15, 16, 17], [2, 18, 19], [2, 30, 31, 32]]
    assert qm.windows(docs, ctx=5, max_tokens=6) == [[2, 10, 11, 12, 13], [2, 14, 15]]


def test_stamp_reuses_and_rebuilds(built, monkeypatch, tmp_path):
    out, stamp = built
    calls = []
    monkeypatch.setattr(qm, "build", lambda d, s: calls.append(s) or _fake_build(d, s))
    assert qm.ensure_quality_model(out, QUICK) == (out, stamp, False)  # same inputs: the cached build
    assert calls == []
    other = tmp_path / "copy"
    shutil.copytree(out, other)
    changed = dataclasses.replace(QUICK, seed=1)
    path, new_stamp, was_built = qm.ensure_quality_model(other, changed)
    assert was_built and calls == [changed] and new_stamp["input_hash"] == qm.input_hash(changed)
    assert qm.ensure_quality_model(other, changed, force=True)[2] and len(calls) == 2
    # A folder that is not a quality-model build is never replaced.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(G4Error, match="holds no quality-model.json"):
        qm.ensure_quality_model(foreign, QUICK)
    assert (foreign / "notes.txt").read_text() == "mine"


def _fake_build(out_dir: Path, settings) -> dict:
    out_dir.mkdir(parents=True)
    stamp = {"input_hash": qm.input_hash(settings)}
    (out_dir / qm.STAMP).write_text(json.dumps(stamp))
    return stamp
