"""Model card (README.md) of g4 results: content from OUT's own files, source metadata,
serve commands, verification table, determinism."""

import json
import shutil

import pytest
import torch
from huggingface_hub import ModelCard

from g4.core.checkpoint import Checkpoint
from g4.convert.int8_neuron import convert_int8_neuron
from g4.convert.nvfp4 import convert_nvfp4
from g4.convert.card import card_inputs, card_text, load_conversion_facts, set_base_model, source_repo_id, write_card
from g4.convert.card import CardError, render_card
from g4.exporters.formats import CARD_FILE, FACTS_FILE

SOURCE_README = """---
license: apache-2.0
library_name: transformers
pipeline_tag: image-text-to-text
base_model: google/the-parent-of-the-source
tags:
- gemma4
---

# A source card whose body must not be copied
"""

VERIFICATION = {
    "g4_verification": 1, "format": "nvfp4", "backend": "vllm", "source": "embedded", "min_agreement": 0.9,
    "passed": True,
    "overall": {"prompts": 12, "token_agreement": 0.9583, "exact_match_prompts": 11, "facts_correct": 12,
                "facts_total": 12, "tool_calls_correct": 1, "tool_calls_total": 2},
    "prompts": [{"prompt": "What is the capital of France? | pipes", "token_agreement": 1.0, "first_divergence": None,
                 "reply": "Paris", "reference_reply": "Paris"}],
    "facts": [{"question": "What is the capital of France?", "answer": "Paris", "reply": "Paris", "ok": True}],
    "tool_calls": [{"question": q, "expected": {"name": "get_weather", "arguments": {"city": c}},
                    "calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}], "content": "",
                    "finish_reason": "tool_calls", "ok": c == "Paris"}
                   for q, c in (("What is the weather in Paris?", "Paris"), ("What is the weather in Rome?", "Rome"))],
    "chat_checks": [{"thinking": t, "stream": s, "ok": not (t and s), "content": "Paris",
                     "problem": "reasoning leaked into content" if (t and s) else None}
                    for t in (False, True) for s in (False, True)],
}


def front_matter(text: str) -> dict:
    return ModelCard(text).data.to_dict()


@pytest.fixture(scope="module")
def hub_cached_src(tmp_path_factory, tiny_mm):
    """tiny_mm laid out as a Hugging Face cache snapshot, with a source README."""
    src = tmp_path_factory.mktemp("cache") / "models--google--gemma-4-tiny-test" / "snapshots" / ("ab" * 20)
    shutil.copytree(tiny_mm, src)
    (src / CARD_FILE).write_text(SOURCE_README)
    return src


@pytest.fixture(scope="module")
def nvfp4_from_cache(tmp_path_factory, hub_cached_src):
    out = tmp_path_factory.mktemp("card_nv") / "gemma-4-tiny-test-nvfp4"
    convert_nvfp4(hub_cached_src, out, weight_only=True, preset="mlp-only", progress=False)
    return out


@pytest.fixture(scope="module")
def int8_out(tmp_path_factory, tiny_mm):
    out = tmp_path_factory.mktemp("card_i8") / "tiny-int8"
    convert_int8_neuron(tiny_mm, out, tp=2, progress=False)
    return out


def test_nvfp4_card_is_written_at_conversion_and_reads_out(tiny_mm_nvfp4, tiny_mm):
    text = (tiny_mm_nvfp4 / CARD_FILE).read_text()
    assert text == card_text(tiny_mm_nvfp4)  # renderable again from OUT alone, same bytes
    meta = front_matter(text)
    assert meta["tags"] == ["nvfp4", "modelopt", "vllm"] and "base_model" not in meta
    # Quantized linears by kind, counted independently from the checkpoint.
    ckpt = Checkpoint(tiny_mm_nvfp4)
    quant = sorted(n[: -len(".weight")] for n, i in ckpt.tensors.items() if i.dtype == torch.uint8)
    experts = [m for m in quant if ".experts." in m]
    assert len(experts) == 2 * 4 * 3
    assert f"| experts | {len(experts)} | 2 layers x 4 experts |" in text
    assert f"| dense MLP | {sum('.mlp.' in m for m in quant)} | 2 layers |" in text
    assert f"| attention | {sum('.self_attn.' in m for m in quant)} | 2 layers |" in text
    params = sum(ckpt.tensors[m + ".weight"].nbytes * 2 for m in quant)
    qbytes = sum(ckpt.tensors[f"{m}.{s}"].nbytes for m in quant
                 for s in ("weight", "weight_scale", "weight_scale_2", "input_scale"))
    assert f"Bits per quantized weight: **{qbytes * 8 / params:.3f}**" in text
    assert "W4A4" in text and "`input_scale` (float32)" in text
    kept_embed = ckpt.tensors["model.language_model.embed_tokens.weight"].nbytes
    assert f"| token embedding | 1 | BF16 | {kept_embed / 1e3:.3f} kB |" in text
    # Serve commands come from g4.serve.vllm_backend: Blackwell native, Hopper Marlin pins.
    assert f"vllm serve ./{tiny_mm_nvfp4.name} --host 127.0.0.1 --port 8000 --quantization modelopt " \
           "--reasoning-parser gemma4" in text
    assert "--moe-backend marlin --linear-backend marlin" in text
    assert "VLLM_NVFP4_GEMM_BACKEND=marlin vllm serve" in text
    assert "Not verified yet" in text and "has not been loaded in vLLM by g4 yet" in text
    assert "Synthetic source" not in text  # only a `g4convert synth` source is called synthetic
    src_bytes = sum(p.stat().st_size for p in tiny_mm.glob("*.safetensors"))
    assert load_conversion_facts(tiny_mm_nvfp4)["source"]["weight_bytes"] == src_bytes
    out_bytes = (tiny_mm_nvfp4 / "model.safetensors").stat().st_size
    assert f"| {out_bytes / 1e3:.3f} kB | {out_bytes / src_bytes:.3f}x |" in text
    assert f"g4convert nvfp4 src {tiny_mm_nvfp4.name} --preset default --algorithm max --calib-samples 4 --calib-seq-len 32 " \
           "--calib-dtype bfloat16" in text
    for p in tiny_mm_nvfp4.iterdir():
        if p.name != CARD_FILE:
            assert f"| `{p.name}` |" in text


def test_card_names_the_repo_and_is_deterministic(tiny_mm_nvfp4, tmp_path):
    a = card_text(tiny_mm_nvfp4, repo_id="someone/tiny-nvfp4")
    assert a == card_text(tiny_mm_nvfp4, repo_id="someone/tiny-nvfp4")
    assert "# tiny-nvfp4" in a and "vllm serve someone/tiny-nvfp4 " in a and f"./{tiny_mm_nvfp4.name}" not in a
    # The same files elsewhere (same directory name) give the same bytes: no paths, no times.
    copy = shutil.copytree(tiny_mm_nvfp4, tmp_path / "x" / tiny_mm_nvfp4.name)
    assert card_text(copy, repo_id="someone/tiny-nvfp4") == a
    assert str(tmp_path) not in a and str(tiny_mm_nvfp4.parent) not in a


def test_render_card_reads_no_file(tiny_mm_nvfp4, tmp_path):
    """render_card is a function of its inputs: gathered once, it renders the same card after
    OUT is gone."""
    out = shutil.copytree(tiny_mm_nvfp4, tmp_path / tiny_mm_nvfp4.name)
    inputs = card_inputs(out, repo_id="someone/tiny-nvfp4")
    shutil.rmtree(out)
    body = render_card(inputs)
    stamped = card_text(tiny_mm_nvfp4, repo_id="someone/tiny-nvfp4")  # the same text plus g4's sha256 line
    assert stamped.startswith(body) and stamped[len(body):].startswith("\n<!-- g4 card sha256 ")


def test_verification_results_are_rendered(tiny_mm_nvfp4, tmp_path):
    from g4.serve.check import weight_fingerprints

    out = shutil.copytree(tiny_mm_nvfp4, tmp_path / "out")
    (out / "verification.json").write_text(json.dumps({**VERIFICATION, "files": weight_fingerprints(out)}))
    text = write_card(out)
    assert "Not verified yet" not in text and "has not been loaded in vLLM" not in text
    assert "| result | PASS (min token agreement 0.9) |" in text
    assert "| greedy token agreement | 0.9583 |" in text and "| facts answered | 12 / 12 |" in text
    assert "3 / 4 ok; thinking=True stream=True: reasoning leaked into content" in text
    assert ("| tool calls (expected function and arguments) | 1 / 2; 'What is the weather in Rome?' -> "
            'get_weather({"city": "Paris"}) |') in text
    assert "capital of France? \\| pipes" in text  # table cells escaped
    assert "| `verification.json` |" in text
    weights = next(out.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the weights change after the check: its PASS must not be shown for them
    weights.write_bytes(bytes(data))
    text = write_card(out)
    assert "NOT VALID FOR THESE FILES: the weight files changed since the check" in text
    assert "| result | PASS" not in text
    (out / "verification.json").write_text(json.dumps(VERIFICATION))
    assert "does not record which weights it checked" in write_card(out)
    (out / "verification.json").write_text(json.dumps({"something": "else"}))
    with pytest.raises(CardError, match="not a g4_verification version 1"):
        card_text(out)


def test_source_metadata_and_base_model_from_hf_cache(nvfp4_from_cache, hub_cached_src):
    assert source_repo_id(hub_cached_src) == "google/gemma-4-tiny-test"
    text = (nvfp4_from_cache / CARD_FILE).read_text()
    meta = front_matter(text)
    assert meta["base_model"] == "google/gemma-4-tiny-test"  # the source, not the source's own parent
    assert meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "image-text-to-text"
    assert meta["tags"] == ["gemma4", "nvfp4", "modelopt", "vllm"]
    assert "whose body must not be copied" not in text
    assert "W4A16" in text and "preset `mlp-only`" in text and "| attention |" in text  # attention kept bf16
    rev = hub_cached_src.name  # the snapshot's commit: the command names exactly what was converted
    assert f"g4convert nvfp4 google/gemma-4-tiny-test@{rev} gemma-4-tiny-test-nvfp4 --preset mlp-only --algorithm mse --weight-only" in text
    assert load_conversion_facts(nvfp4_from_cache)["source"]["name"] == "gemma-4-tiny-test"  # not the snapshot's commit


def test_set_base_model_rewrites_facts_and_card(tiny_mm_nvfp4, tmp_path):
    out = shutil.copytree(tiny_mm_nvfp4, tmp_path / "out")
    set_base_model(out, "someone/gemma-tiny")
    assert load_conversion_facts(out)["base_model"] == "someone/gemma-tiny"
    meta = front_matter((out / CARD_FILE).read_text())
    assert meta["base_model"] == "someone/gemma-tiny" and meta["base_model_relation"] == "quantized"
    with pytest.raises(CardError, match="not a Hub repo id|namespace/name"):
        set_base_model(out, "../not a repo")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # atomic writes left no temp files


def test_int8_neuron_card(int8_out):
    text = (int8_out / CARD_FILE).read_text()
    assert text == card_text(int8_out)
    meta = front_matter(text)
    assert meta["tags"] == ["neuron", "inferentia2", "int8"] and meta["pipeline_tag"] == "text-generation"
    manifest = json.loads((int8_out / "manifest.json").read_text())
    plan = manifest["memory_plan"]
    assert f"| experts | {plan['experts'] / 1e3:.3f} kB |" in text
    assert "FITS" in text and "TP=2" in text and "inf2.xlarge" in text
    assert "../shared" not in text  # no local spec paths in a public card
    # Bits per int8 weight with its fp32 scales, computed here from rank 0's tensors.
    from safetensors.torch import load_file

    t = load_file(int8_out / manifest["rank_files"][0])
    w8 = [n for n, v in t.items() if v.dtype == torch.int8]
    bits = sum(t[n].numel() * 8 + t[n[: -len("weight")] + "scale"].numel() * 32 for n in w8) / sum(t[n].numel()
                                                                                                    for n in w8)
    assert f"**{bits:.3f}**" in text
    assert f"g4serve ./{int8_out.name} --backend neuron" in text
    assert "has not yet run on Inferentia2 hardware" in text
    pushed = card_text(int8_out, repo_id="someone/tiny-int8")
    assert "hf download someone/tiny-int8 --local-dir tiny-int8\ng4serve tiny-int8 --backend neuron" in pushed


def test_not_a_g4_result(tiny_mm, tmp_path):
    with pytest.raises(CardError, match=f"no {FACTS_FILE}"):
        card_text(tiny_mm)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / FACTS_FILE).write_text('{"g4_conversion": 99}')
    with pytest.raises(CardError, match="not a g4_conversion version 1"):
        load_conversion_facts(bad)


def test_one_layer_and_missing_values_read_as_english(tmp_path):
    """'1 layer x 1 expert', not '1 layers x 1 experts'; a prompt whose replies agree shows
    'none (replies agree)' as its first divergence, and a missing value a dash, not 'None'."""
    import tiny
    from g4.serve.check import weight_fingerprints

    src = tiny.build(tmp_path / "src", num_hidden_layers=1, layer_types=["full_attention"], num_experts=1,
                     top_k_experts=1)
    out = tmp_path / "out"
    convert_nvfp4(src, out, weight_only=True, progress=False)
    overall = {k: v for k, v in VERIFICATION["overall"].items() if k != "exact_match_prompts"}
    verification = {**VERIFICATION, "overall": overall, "files": weight_fingerprints(out)}
    (out / "verification.json").write_text(json.dumps(verification))
    text = write_card(out)
    assert "| experts | 3 | 1 layer x 1 expert |" in text and "| attention | 3 | 1 layer |" in text
    assert "| What is the capital of France? \\| pipes | 1.0 | none (replies agree) |" in text
    assert "| prompts with identical replies | - |" in text
    assert "None" not in text and "1 layers" not in text


def test_an_f32_source_is_named_f32_and_its_kept_tensors_as_stored(tmp_path):
    """Fresh-user finding: an F32 source keeps norms and embeddings in F32 in the NVFP4 result while
    the card called the source bf16 (from config.json's dtype). The card now reads the tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    from g4.convert.embedded_model import EMBEDDED_DIR
    from g4.convert.nvfp4 import convert_nvfp4

    src = shutil.copytree(EMBEDDED_DIR, tmp_path / "f32")
    sd = load_file(src / "model.safetensors")
    save_file({k: v.float() for k, v in sd.items()}, src / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((src / "config.json").read_text())["dtype"] == "bfloat16"  # unchanged
    out = tmp_path / "out"
    convert_nvfp4(src, out, weight_only=True, progress=False)
    card = (out / CARD_FILE).read_text()
    assert "| source (float32, 1 file) |" in card and "bfloat16, 1 file" not in card
    ckpt = Checkpoint(out)
    kept = {i.dtype for n, i in ckpt.tensors.items() if "norm" in n or "embed_tokens" in n}
    assert kept == {torch.float32}
    assert "| norms | 37 | F32 |" in card and "| token embedding | 1 | F32 |" in card
