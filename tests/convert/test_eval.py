"""g4convert eval: llama.cpp's perplexity --kl-divergence statistics, layer-streamed, against
whole-model computations on the embedded model (NVFP4 W4A4 and W4A16, int8-neuron TP 2)."""

import json
import math

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from g4.convert.cli import main
from g4.convert.embedded_model import EMBEDDED_DIR
from g4.convert.evaluate import (
    DEFAULT_TEXT_FILE,
    TokenStats,
    eval_chunks,
    evaluate,
    summarize,
    token_stats,
)
from g4.convert.calibrate import read_calibration_texts
from g4.convert.int8_neuron import convert_int8_neuron
from g4.convert.nvfp4 import convert_nvfp4
from g4.convert.reference import load_converted_model, load_source_model
from g4.convert.stream import Int8NeuronStream, Nvfp4Stream, SourceStream
from g4.exporters.neuron_int8 import geometry, layer_entries, model_entries, is_rank_index, shard, unshard
from g4.exporters.output_dir import foreign_files

CTX, MAX_TOKENS = 128, 512  # 4 chunks past the embedded model's 64-token sliding window; 63 scored each
STATS = ("ppl_src", "ppl_out", "ppl_ratio", "top1_agreement", "rms_dp", "tokens")
KLD = ("mean", "median", "p90", "p99", "p999", "max")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    convert_nvfp4(EMBEDDED_DIR, root / "w4a4", calib_samples=8, calib_seq_len=64, progress=False)
    convert_nvfp4(EMBEDDED_DIR, root / "w4a16", weight_only=True, progress=False)
    convert_int8_neuron(EMBEDDED_DIR, root / "int8", tp=2, progress=False)
    return root


def chunks():
    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    ids, _ = eval_chunks(tok, read_calibration_texts(DEFAULT_TEXT_FILE), ctx=CTX, max_tokens=MAX_TOKENS, text_name="t")
    assert ids.shape == (MAX_TOKENS // CTX, CTX) and (ids[:, 0] == tok.bos_token_id).all()
    return ids


def whole_model_stats(src_logits, out_logits, ids) -> dict:
    """The statistics from whole-model logits ``[n, ctx, V]``: positions ctx/2 .. ctx-2 of each
    chunk predict its tokens ctx/2+1 .. ctx-1 (llama.cpp's second half)."""
    first = CTX // 2
    parts = [token_stats(torch.log_softmax(s[first:-1].float(), -1), torch.log_softmax(q[first:-1].float(), -1),
                         c[first + 1 :]) for s, q, c in zip(src_logits, out_logits, ids)]
    return summarize(TokenStats.cat(parts))


def assert_same(got: dict, want: dict, rel: float, quantile_rel: float | None = None) -> None:
    """Every statistic within ``rel``; the KLD quantiles (median ... max) within ``quantile_rel``
    (default ``rel``)."""
    assert got["tokens"] == want["tokens"] == (MAX_TOKENS // CTX) * (CTX - 1 - CTX // 2)
    for k in STATS:
        assert got[k] == pytest.approx(want[k], rel=rel, abs=1e-7), k
    for k in KLD:
        tol = rel if k == "mean" or quantile_rel is None else quantile_rel
        assert got["kld"][k] == pytest.approx(want["kld"][k], rel=tol, abs=1e-7), k


def test_formulas_on_hand_computed_distributions():
    # P = (1/2, 1/4, 1/4), Q = (1/4, 1/2, 1/4), next token 0:
    # KLD = 1/2 ln 2 + 1/4 ln(1/2) = ln(2)/4; -log P(0) = ln 2, -log Q(0) = ln 4; dp = 1/4 - 1/2; tops differ
    lp = torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]).log()
    lq = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]]).log()
    s = token_stats(lp, lq, torch.tensor([0, 2]))
    assert s.kld[0].item() == pytest.approx(math.log(2) / 4, rel=1e-6) and s.kld[1].item() == 0
    assert s.nll_src.tolist() == pytest.approx([math.log(2), math.log(4)])
    assert s.nll_out.tolist() == pytest.approx([math.log(4), math.log(4)])
    assert s.dp.tolist() == pytest.approx([-0.25, 0.0]) and s.same_top.tolist() == [False, True]
    # llama.cpp's summaries on 11 tokens with KLD 1..11, nll_src 1.0, nll_out 1.0 or 2.0, dp +-0.1
    n = 11
    kld = torch.arange(1, n + 1, dtype=torch.float64)
    nll_out = torch.tensor([1.0, 2.0] * 5 + [1.0], dtype=torch.float64)
    dp = torch.tensor([0.1, -0.1] * 5 + [0.1], dtype=torch.float64)
    r = summarize(TokenStats(torch.ones(n, dtype=torch.float64), nll_out, kld, torch.tensor([True] * 8 + [False] * 3),
                             dp))
    assert r["tokens"] == n and r["ppl_src"] == pytest.approx(math.e)
    assert r["ppl_out"] == pytest.approx(math.exp(16 / 11)) and r["ppl_ratio"] == pytest.approx(math.exp(5 / 11))
    assert r["kld"] == pytest.approx({"mean": 6.0, "median": 6.0, "p90": 10.0, "p99": 10.9, "p999": 10.99,
                                      "max": 11.0, "min": 1.0})
    assert r["top1_agreement"] == pytest.approx(8 / 11) and r["rms_dp"] == pytest.approx(0.1)
    u = r["uncertainty"]
    assert u["kld_mean"] == pytest.approx(math.sqrt((sum(k * k for k in range(1, 12)) / 11 - 36) / 10))
    assert u["top1_agreement"] == pytest.approx(math.sqrt(8 / 11 * 3 / 11 / 10))
    assert u["rms_dp"] == 0.0  # every dp^2 equal: no spread
    assert u["ppl_src"] == 0.0  # nll_src constant
    var_out = (6 * 1 + 5 * 4) / 11 - (16 / 11) ** 2
    assert u["ppl_out"] == pytest.approx(math.exp(16 / 11) * math.sqrt(var_out / 10))
    even = summarize(TokenStats(*(torch.tensor([1.0, 3.0, 2.0, 4.0], dtype=torch.float64),) * 3,
                                torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.float64)))
    assert even["kld"]["median"] == 2.5 and even["uncertainty"]["kld_mean"] == 0.0  # n <= 10: no error bar


def test_source_against_itself_is_exactly_zero():
    r = evaluate(EMBEDDED_DIR, EMBEDDED_DIR, max_tokens=MAX_TOKENS, ctx=CTX, dtype=torch.float32, write=False)
    assert r["format"] == "bf16" and r["tokens"] == 252
    assert r["kld"] == {k: 0.0 for k in ("mean", "median", "p90", "p99", "p999", "max", "min")}
    assert r["top1_agreement"] == 1.0 and r["rms_dp"] == 0.0 and r["ppl_ratio"] == 1.0 and r["ppl_src"] == r["ppl_out"]


@pytest.mark.parametrize("kind", ["w4a4", "w4a16"])
def test_streamed_statistics_equal_whole_models(results, kind):
    """Every statistic of the layer-streamed eval equals the one computed from the whole
    transformers models' logits (W4A4: activation fake-quant installed on the whole model too)."""
    ids = chunks()
    w4a4 = kind == "w4a4"
    with torch.no_grad():
        src = load_source_model(EMBEDDED_DIR, torch.float32)
        out = load_converted_model(results / kind, EMBEDDED_DIR, torch.float32, act_quant=w4a4)
        want = whole_model_stats(src(ids).logits, out(ids).logits, ids)
    got = evaluate(results / kind, EMBEDDED_DIR, max_tokens=MAX_TOKENS, ctx=CTX, dtype=torch.float32, write=False)
    assert got["act_quant"] is w4a4 and got["kld"]["mean"] > 1e-3
    assert_same(got, want, rel=1e-4)


def test_the_head_phase_shares_a_head_only_when_its_bytes_are_the_sources(results, tmp_path):
    """A tied NVFP4 result keeps its source's bf16 embedding as its head: the head phase then
    holds one [V, H] copy, decided from the files (never a second copy); a head changed in one
    value, or an int8 head, is its own."""
    src = SourceStream(EMBEDDED_DIR, torch.float32)
    norm, head = src.head_weights()
    res = Nvfp4Stream(results / "w4a16", torch.float32, act_quant=False)
    assert res.head_equals(head) and torch.equal(res.final_norm_weight(), res.head_weights()[0])
    planted = head.clone()
    planted[7, 3] += 1
    assert not res.head_equals(planted)
    int8 = Int8NeuronStream(results / "int8", torch.float32)
    assert not int8.head_equals(head) and torch.equal(int8.final_norm_weight(), int8.head_weights()[0])


def test_int8_neuron_statistics_equal_the_emulator(results):
    """The int8-neuron result read layer by layer (rank files unsharded by the layout table's rules)
    gives the statistics of the CPU tensor-parallel emulator, which loads every rank whole."""
    from g4.serve.neuron_emulator import NeuronEmulator

    ids = chunks()
    with torch.no_grad():
        src = load_source_model(EMBEDDED_DIR, torch.float32)
        want = whole_model_stats(src(ids).logits, NeuronEmulator(results / "int8")(ids), ids)
    got = evaluate(results / "int8", EMBEDDED_DIR, max_tokens=MAX_TOKENS, ctx=CTX, dtype=torch.float32, write=False)
    assert got["format"] == "int8-neuron" and got["kld"]["mean"] > 1e-5
    # A single token's KLD (1e-4 here) moves by a few parts in 1e3 between the emulator's per-rank
    # fp32 matmuls and the unsharded ones, and a quantile is one token's value (measured: the median
    # 2.0e-3 apart); the mean and the other statistics average over every token.
    assert_same(got, want, rel=1e-3, quantile_rel=5e-3)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_unshard_inverts_shard_for_every_entry(tp):
    config = json.loads((EMBEDDED_DIR / "config.json").read_text())
    g = geometry(config, tp)
    torch.manual_seed(0)
    for L in range(g.num_layers):
        shapes = g.arch.layer_tensor_shapes(L)
        for e in layer_entries(has_v=g.has_v[L], quantize_attention=False):
            if is_rank_index(e):
                continue
            full = torch.randn(shapes[e.source])
            back = unshard(e, [shard(e, full, g, L, r)[0] for r in range(tp)], g, L)
            assert torch.equal(back, full), (L, e.key)
    lm = next(e for e in model_entries(tied=g.arch.tied) if e.key == "lm_head")
    full = torch.randn(g.vocab, g.hidden)
    assert torch.equal(unshard(lm, [shard(lm, full, g, None, r)[0] for r in range(tp)], g, None), full)


def test_cli_json_eval_file_card_and_bad_text(results, tmp_path):
    out = results / "w4a16"
    r = CliRunner().invoke(main, ["-q", "eval", str(out), "--max-tokens", str(MAX_TOKENS), "--ctx", str(CTX), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert {"ppl_src", "ppl_out", "ppl_ratio", "kld", "top1_agreement", "rms_dp", "tokens"} <= set(report)
    assert set(report["kld"]) >= {"mean", "median", "p90", "p99", "p999", "max"}
    written = json.loads((out / "eval.json").read_text())
    assert written["kld"] == report["kld"] and written["against"]["name"] == "embedded"
    assert str(tmp_path.parent.parent) not in (out / "eval.json").read_text()  # no local path
    card = (out / "README.md").read_text()
    assert "## Quality on held-out text" in card and f"{report['kld']['mean']:.6f}" in card
    assert foreign_files(out) == []  # eval.json is one of g4's own files (--overwrite may replace OUT)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    before = (out / "eval.json").read_bytes()
    r = CliRunner().invoke(main, ["-q", "eval", str(out), "--text", str(bad)])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {bad}:2: invalid JSON"), r.stderr
    assert (out / "eval.json").read_bytes() == before  # the earlier report is untouched


def test_ctrl_c_after_the_report_is_written_says_it_is_kept(results, monkeypatch):
    """A Ctrl-C while the model card is re-rendered, after eval.json is in place: exit 130 and a
    message that eval.json is complete and kept (it said nothing was written to OUT), and no
    temporary file of the card left in OUT."""
    import os
    import signal

    import g4.convert.card as card

    out = results / "w4a16"
    real = card.card_text

    def interrupted(*args, **kwargs):
        text = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return text

    monkeypatch.setattr(card, "card_text", interrupted)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        r = CliRunner().invoke(main, ["-q", "eval", str(out), "--max-tokens", str(MAX_TOKENS), "--ctx", str(CTX)])
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert r.exit_code == 130, r.output
    assert f"interrupted after {out / 'eval.json'} was complete; it is kept" in r.output, r.output
    assert not [p.name for p in out.iterdir() if p.name.startswith((".README.md.", ".eval.json."))]
