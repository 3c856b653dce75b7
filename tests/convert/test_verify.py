"""The embedded model through NVFP4 and back: it must still answer its facts (CPU reference)."""

import pytest
import torch
from tampered import NVFP4_TAMPERS, assert_one_error_line, tampered_copy

from g4.convert.embedded_model import EMBEDDED_DIR
from g4.convert.nvfp4 import convert_nvfp4
from g4.convert.reference import compare_models, load_converted_model, load_source_model
from g4.convert.verify import verify_nvfp4


@pytest.fixture(scope="module")
def embedded_nvfp4(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded") / "nvfp4"
    convert_nvfp4(EMBEDDED_DIR, out, progress=False)
    return out


def test_embedded_nvfp4_still_answers(embedded_nvfp4):
    report = verify_nvfp4(embedded_nvfp4, EMBEDDED_DIR, act_quant=False)  # weight-only arithmetic
    assert report.facts_total == 12 and report.facts_correct == 12, report.summary()
    assert report.token_agreement >= 0.9 and report.mean_kl < 0.5, report.summary()
    assert not report.failures(0.9)


def test_w4a4_emulation_still_answers(embedded_nvfp4):
    report = verify_nvfp4(embedded_nvfp4, EMBEDDED_DIR, max_new_tokens=4)  # W4A4 by default, as g4serve check
    assert report.act_quant and report.facts_correct == 12, report.summary()


def test_metrics_detect_embedding_scale_bugs(embedded_nvfp4):
    """P12: the embedding scale applied twice is caught outright; dropped, it shows in the KL."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    prompts = ["What is 2+2?", "Hello", "What is the capital of Japan?"]
    src = load_source_model(EMBEDDED_DIR)
    assert compare_models(src, src, tok, prompts[:1])["all_mean_kl"] == pytest.approx(0.0, abs=1e-6)
    good = compare_models(src, load_converted_model(embedded_nvfp4, EMBEDDED_DIR), tok, prompts)

    def with_embed_scale(value):
        model = load_converted_model(embedded_nvfp4, EMBEDDED_DIR)
        model.model.language_model.embed_tokens.embed_scale.fill_(value)
        return compare_models(src, model, tok, prompts)

    twice = with_embed_scale(128.0)  # sqrt(128) ** 2
    assert twice["token_agreement"] < 0.5 and twice["mean_kl"] > 1.0
    dropped = with_embed_scale(1.0)
    assert dropped["all_mean_kl"] > 1.5 * good["all_mean_kl"]
    assert dropped["all_token_agreement"] < good["all_token_agreement"]


def test_dequantized_state_matches_quantizer(embedded_nvfp4):
    """Re-fused experts: rows [0, I) are gate_proj, [I, 2I) up_proj, and close to the bf16 source."""
    from safetensors.torch import load_file

    from g4.convert.reference import load_nvfp4_as_hf

    sd, scales = load_nvfp4_as_hf(embedded_nvfp4, torch.float32)
    src = load_file(EMBEDDED_DIR / "model.safetensors")
    key = "model.language_model.layers.2.experts.gate_up_proj"
    assert sd[key].shape == src[key].shape
    rel = (sd[key] - src[key].float()).norm() / src[key].float().norm()
    assert rel < 0.15
    assert "model.language_model.layers.2.experts.down_proj" in scales
    # each expert's rows exactly where transformers' layer reads them, dequantized from its own linears
    from g4.core.checkpoint import Checkpoint
    from g4.quantizers.nvfp4 import dequantize_tensors

    out = Checkpoint(embedded_nvfp4)
    layer = "model.language_model.layers.2."

    def expert(e: int, proj: str) -> torch.Tensor:
        m = f"{layer}experts.{e}.{proj}."
        return dequantize_tensors(out.get(m + "weight"), out.get(m + "weight_scale"), out.get(m + "weight_scale_2"))

    n_experts, inter = sd[key].shape[0], sd[key].shape[1] // 2
    for e in range(n_experts):
        assert torch.equal(sd[key][e, :inter], expert(e, "gate_proj")), e
        assert torch.equal(sd[key][e, inter:], expert(e, "up_proj")), e
        assert torch.equal(sd[f"{layer}experts.down_proj"][e], expert(e, "down_proj")), e


def test_verify_refuses_wrong_inputs(embedded_nvfp4, tiny_mm, tmp_path):
    from g4.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not a modelopt NVFP4 checkpoint"):
        verify_nvfp4(EMBEDDED_DIR, EMBEDDED_DIR)  # a bf16 source passed as OUT
    with pytest.raises(CheckpointError, match="differs from .*; was it converted from another checkpoint"):
        verify_nvfp4(embedded_nvfp4, tiny_mm)
    w4a16 = tmp_path / "w4a16"
    convert_nvfp4(EMBEDDED_DIR, w4a16, weight_only=True, progress=False)
    with pytest.raises(CheckpointError, match="--act-quant needs input_scale tensors"):
        verify_nvfp4(w4a16, EMBEDDED_DIR, act_quant=True)


def test_verify_cli_emulates_w4a4_by_default_like_check_and_refuses_int8_neuron(tiny_mm_nvfp4, tiny_mm, tmp_path):
    import json

    from click.testing import CliRunner

    from g4.convert.cli import main
    from g4.convert.int8_neuron import convert_int8_neuron
    from g4.serve.engine import load_cpu_engine

    def verify(*args):
        return CliRunner().invoke(main, ["-q", "verify", *args, "--against", str(tiny_mm), "--max-new-tokens", "1",
                                         "--min-agreement", "0"])

    assert "W4A4 activation emulation" in load_cpu_engine(tiny_mm_nvfp4).description  # g4serve check's default
    r = verify(str(tiny_mm_nvfp4), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["act_quant"] is True
    r = verify(str(tiny_mm_nvfp4), "--no-act-quant")
    assert r.exit_code == 0 and "(W4A16 emulation)" in r.output, r.output
    int8_out = tmp_path / "int8"
    convert_int8_neuron(tiny_mm, int8_out, tp=2, progress=False)
    r = verify(str(int8_out))
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output == (f"error: {int8_out}: an int8-neuron result; verify checks NVFP4 results, int8-neuron "
                        f"results are checked with `g4serve check {int8_out} --against SRC`\n")


# ----------------------------------------------------------------- the layer-streaming reference

LONG_PROMPT = ("Tell me about the capital of France, the capital of Japan, the capital of Italy, the largest "
               "planet in the solar system, the colour of a clear sky, the author of Hamlet and the number of "
               "days in a week, in that order please.")


def _long_ids(tok):
    from g4.convert.reference import chat_prompt_ids

    ids = chat_prompt_ids(tok, LONG_PROMPT)[0].tolist()
    assert len(ids) > 64  # longer than the embedded model's sliding window: sliding and full masks differ
    return ids


def test_streamed_source_equals_whole_model_fp32():
    """Layer order, per-type masks and RoPE, embedding scale, norm, head and softcap: the streamed
    source must give transformers' own whole-model logits (fp32) on a sequence past the sliding window."""
    from transformers import AutoTokenizer

    from g4.convert.stream import SourceStream, streamed_logits

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    whole = load_source_model(EMBEDDED_DIR, torch.float32)
    streamed = SourceStream(EMBEDDED_DIR, torch.float32)
    seqs = [_long_ids(tok), chat_prompt_ids_of(tok, "What is 2+2?")]
    got = streamed_logits(streamed, seqs)
    for seq, logits in zip(seqs, got):
        want = whole(torch.tensor([seq])).logits[0]
        assert logits.shape == want.shape
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def chat_prompt_ids_of(tok, text):
    from g4.convert.reference import chat_prompt_ids

    return chat_prompt_ids(tok, text)[0].tolist()


def test_streamed_greedy_equals_whole_model_greedy():
    """KV-cached streamed generation = argmax of the whole model recomputed at every step, past the
    sliding window (the cache's sliding layers and the masks built against the cache)."""
    from transformers import AutoTokenizer

    from g4.convert.stream import SourceStream, streamed_greedy

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    whole = load_source_model(EMBEDDED_DIR, torch.float32)
    prompts = [_long_ids(tok), chat_prompt_ids_of(tok, "Who wrote Hamlet?")]
    got = streamed_greedy(SourceStream(EMBEDDED_DIR, torch.float32), prompts, max_new_tokens=6)
    for prompt, new in zip(prompts, got):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(whole(torch.tensor([seq])).logits[0, -1].argmax()))
        assert new == seq[len(prompt):]
    # with the stop ids: as generate(do_sample=False) with the model's generation config
    from g4.convert.verify import eos_token_ids

    short = prompts[1:]
    want = whole.generate(torch.tensor(short), max_new_tokens=6, do_sample=False)[0, len(short[0]):].tolist()
    assert streamed_greedy(SourceStream(EMBEDDED_DIR, torch.float32), short, max_new_tokens=6,
                           eos_token_ids=eos_token_ids(EMBEDDED_DIR)) == [want]


def test_streamed_metrics_equal_whole_model_metrics(embedded_nvfp4):
    """verify's streamed comparison (W4A4 emulation on) gives compare_models' figures on the whole
    models, and its per-layer hidden-state errors are those of the whole models' hidden states."""
    from transformers import AutoTokenizer

    from g4.convert.stream import Nvfp4Stream, SourceStream, compare_streamed

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    prompts = ["What is 2+2?", LONG_PROMPT]
    whole_src = load_source_model(EMBEDDED_DIR, torch.float32)
    whole_q = load_converted_model(embedded_nvfp4, EMBEDDED_DIR, torch.float32, act_quant=True)
    want = compare_models(whole_src, whole_q, tok, prompts, max_new_tokens=5)
    ids = [chat_prompt_ids_of(tok, p) for p in prompts]
    seqs = [whole_src.generate(torch.tensor([i]), max_new_tokens=5, do_sample=False)[0].tolist() for i in ids]
    src, res = SourceStream(EMBEDDED_DIR, torch.float32), Nvfp4Stream(embedded_nvfp4, torch.float32, act_quant=True)
    got = compare_streamed(src, res, seqs, [len(i) for i in ids])
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # per layer: ||h_q - h_s|| / ||h_s|| over continuation positions, from the whole models' hidden states
    with torch.no_grad():
        hs = [whole_src(torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
        hq = [whole_q(torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
    n = len(got["layer_rel_error"])
    assert n == 4
    for layer in range(n - 1):  # the whole model's last entry is after the final norm
        r = [slice(len(i) - 1, len(s) - 1) for i, s in zip(ids, seqs)]
        err = sum((q[layer + 1][0, x] - s[layer + 1][0, x]).square().sum() for q, s, x in zip(hq, hs, r))
        ref = sum(s[layer + 1][0, x].square().sum() for s, x in zip(hs, r))
        assert got["layer_rel_error"][layer] == pytest.approx(float((err / ref).sqrt()), rel=1e-4)
    assert all(0 < e < 1 for e in got["layer_rel_error"])
    # the activation fake-quant is part of what was compared: without it the figures move
    w4a16 = compare_streamed(src, Nvfp4Stream(embedded_nvfp4, torch.float32), seqs, [len(i) for i in ids])
    assert w4a16["all_mean_kl"] != pytest.approx(got["all_mean_kl"], rel=1e-2)
    same = compare_streamed(src, SourceStream(EMBEDDED_DIR, torch.float32), seqs, [len(i) for i in ids])
    assert same["layer_rel_error"] == [0.0] * 4 and same["all_mean_kl"] == pytest.approx(0.0, abs=1e-6)


def test_verify_reports_layer_errors(embedded_nvfp4, capfd):
    import json

    report = verify_nvfp4(embedded_nvfp4, EMBEDDED_DIR, act_quant=False, max_new_tokens=2, progress=True)
    # the progress bar (a fresh user saw nothing for 7 minutes): decoder layers run, 2 tokens of SRC
    # greedy + both sides compared + 8 answer tokens per fact, over 4 layers
    bar = capfd.readouterr().err.split("\r")
    total = (2 + 2 + 8) * 4
    assert any(f"verify {embedded_nvfp4.name}:" in b and f" 0/{total} " in b for b in bar), bar[:3]
    assert f"{total}/{total}" in bar[-1] or f"{total}/{total}" in bar[-2]
    assert any("SRC greedy" in b for b in bar) and any("comparing" in b for b in bar) and any("facts" in b for b in bar)
    assert len(report.layer_rel_error) == 4 and all(0 < e < 1 for e in report.layer_rel_error)
    assert json.loads(report.to_json())["layer_rel_error"] == report.layer_rel_error
    assert "hidden-state relative error per layer: 0:" in report.summary()


def test_converted_reference_keeps_rope_inv_freq_fp32_like_the_source(embedded_nvfp4):
    """A bf16 whole-model reference built with .to(bf16) had bf16 RoPE frequencies, which the source
    (from_pretrained) and the streamed reference do not: a RoPE error counted as quantization error."""
    def inv_freq(model):
        return {k: v.dtype for k, v in model.named_buffers() if k.endswith("inv_freq")}

    src = inv_freq(load_source_model(EMBEDDED_DIR))
    assert src and set(src.values()) == {torch.float32}
    assert inv_freq(load_converted_model(embedded_nvfp4, EMBEDDED_DIR)) == src

@pytest.mark.parametrize("kind", sorted(NVFP4_TAMPERS))
def test_verify_cli_refuses_a_result_that_differs_from_its_table(kind, embedded_nvfp4, tmp_path):
    """The output table is checked before the reference trusts OUT: one line naming the file,
    the tensor and what differs, exit 2 (not a PASS, a KeyError or a torch traceback)."""
    from click.testing import CliRunner

    from g4.convert.cli import main

    mutate, expected = NVFP4_TAMPERS[kind]
    bad = tampered_copy(embedded_nvfp4, tmp_path / "bad", mutate)
    r = CliRunner().invoke(main, ["-q", "verify", str(bad), "--against", "embedded"])
    assert r.exit_code == 2
    assert_one_error_line(r.output, bad / "model.safetensors", expected)
