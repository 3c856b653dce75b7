"""The embedded model through NVFP4 and back: it must still answer its facts (CPU reference)."""

import pytest
import torch
from tampered import NVFP4_TAMPERS, assert_one_error_line, tampered_copy

from g4.convert.embedded_model import EMBEDDED_DIR
from g4.convert.nvfp4 import convert_nvfp4
from g4.convert.reference import compare_models, load_converted_model, load_source_model, verify_nvfp4


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


def test_verify_refuses_wrong_inputs(embedded_nvfp4, tiny_mm, tmp_path):
    from g4.convert.errors import CheckpointError

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
