"""``g4convert eval``: a result against its source on held-out text, with the statistics of
llama.cpp's ``perplexity --kl-divergence`` (ggml-org/llama.cpp ``tools/perplexity/perplexity.cpp``).

Both models are teacher-forced over the same tokens, one decoder layer at a time
(:mod:`g4.convert.stream`: SRC's layers over every chunk, then OUT's; never two layers in RAM,
never a whole model), and compared position by position. SRC's last hidden states are kept
between runs (:class:`g4.convert.stream.SourceSideCache`, with SRC's provenance): a later eval
against the same SRC on the same text reads only SRC's embedding and final norm (its head).

Tokens and chunks, as llama.cpp's ``perplexity`` cuts them: the text's documents are tokenized
one after another (each starts with ``<bos>``, as the tokenizer adds it) into one stream, the
first ``max_tokens`` of it are cut into ``n = max_tokens // ctx`` chunks of ``ctx`` tokens (a
partial last chunk is dropped), and the first token of every chunk is replaced by ``<bos>``.
Each chunk runs from an empty context. **Scored: only the second half of each chunk**, as
llama.cpp scores it (``first = ctx / 2``): the logits at positions ``first .. ctx - 2`` predict
tokens ``first + 1 .. ctx - 1``, ``ctx - 1 - ctx // 2`` tokens per chunk, so every scored token
has at least ``ctx / 2`` tokens of context.

Per scored token, with ``P`` = SRC's next-token distribution (llama.cpp's "base") and ``Q`` =
OUT's, both ``log_softmax`` of fp32 logits over the whole vocabulary:

- ``nll_src = -log P(t)``, ``nll_out = -log Q(t)`` for the text's next token ``t``;
- ``kld = sum_v P(v) (log P(v) - log Q(v))`` in nats. llama.cpp stores the base log-probs as
  uint16 and skips ``log P(v) <= -16``; here both are exact fp32, so a figure can differ from
  llama.cpp's by that rounding (SRC against itself gives exactly 0);
- ``same top``: ``argmax Q == argmax P``; ``dp = Q(t) - P(t)``.

Summaries (llama.cpp's formulas): ``PPL = exp(mean nll)``; the ratio
``PPL(OUT)/PPL(SRC) = exp(mean nll_out - mean nll_src)``; KLD mean, median (the mean of the two
middle values for an even count), percentiles by linear interpolation at ``f * (n - 1)`` of
the sorted values, max; top-1 agreement = share of ``same top``; ``RMS dp = sqrt(mean dp^2)``.
Uncertainties ("±", one standard error) as llama.cpp: ``sqrt((mean x^2 - mean^2) / (n - 1))``
for a mean (0 for ``n <= 10``), ``PPL * se(mean nll)``, the ratio's from both standard errors
and their covariance, ``sqrt(p (1 - p) / (n - 1))`` for the agreement, and
``se(mean dp^2) / (2 RMS)`` for RMS dp.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.convert.calibrate import calibration_device, read_calibration_texts
from g4.convert.card import EVAL_VERSION, hf_cache_repo_id, hf_cache_revision, rerender_card
from g4.convert.resolve import EMBEDDED_DIR
from g4.convert.stream import Int8NeuronStream, Nvfp4Stream, SourceSideCache, SourceStream, run_layer
from g4.core.checkpoint import check_converted_from, weight_fingerprints
from g4.core.errors import CheckpointError, G4Error, OptionError
from g4.core.progress import progress_bar
from g4.exporters.formats import BF16, EVAL_FILE, INT8_NEURON, NVFP4, check_result
from g4.exporters.output_dir import write_text_atomic

log = logging.getLogger(__name__)

DEFAULT_TEXT_FILE = Path(__file__).parent / "data" / "eval_text.jsonl"
DEFAULT_CTX = 512  # llama.cpp perplexity's default -c
DEFAULT_MAX_TOKENS = 4096  # 8 chunks of 512: 2040 scored tokens
MAX_TOKENS_PER_FORWARD = 4096  # chunks run through a layer together, at most this many tokens
HEAD_ROWS = 32  # scored positions per head step: two [32, V] fp32 blocks (64 MiB for V = 262144)
KLD_PERCENTILES = {"p90": 0.90, "p99": 0.99, "p999": 0.999}
_HIDDEN = "hidden"  # SRC's final hidden states in its SourceSideCache entry


# --------------------------------------------------------------------------- statistics


@dataclass
class TokenStats:
    """Per scored token, float64 ``[n]`` (``same_top``: bool ``[n]``); see the module docstring."""

    nll_src: torch.Tensor
    nll_out: torch.Tensor
    kld: torch.Tensor
    same_top: torch.Tensor
    dp: torch.Tensor

    @classmethod
    def cat(cls, parts: list["TokenStats"]) -> "TokenStats":
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in cls.__dataclass_fields__))


def token_stats(lp: torch.Tensor, lq: torch.Tensor, targets: torch.Tensor) -> TokenStats:
    """Per-position statistics of two next-token distributions.

    Args:
        lp: fp32 ``[n, V]`` log-probabilities of SRC (``P``, llama.cpp's base).
        lq: fp32 ``[n, V]`` log-probabilities of OUT (``Q``).
        targets: int64 ``[n]`` the token that followed each position in the text.

    Returns:
        :class:`TokenStats` (nats; ``dp`` as a probability difference ``Q(t) - P(t)``).
    """
    t = targets.to(lp.device).unsqueeze(1)
    lp_t, lq_t = lp.gather(1, t)[:, 0].double(), lq.gather(1, t)[:, 0].double()
    kld = (lp.exp() * (lp - lq)).sum(-1).double()
    return TokenStats(nll_src=-lp_t.cpu(), nll_out=-lq_t.cpu(), kld=kld.cpu(),
                      same_top=(lp.argmax(-1) == lq.argmax(-1)).cpu(), dp=(lq_t.exp() - lp_t.exp()).cpu())


def _mean_se(x: torch.Tensor) -> tuple[float, float]:
    """llama.cpp's ``mean_and_uncertainty``: the mean and its standard error (0 for n <= 10)."""
    n = x.numel()
    if n < 1:
        return 0.0, 0.0
    mean = float(x.sum()) / n
    var = float((x * x).sum()) / n - mean * mean
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def _percentile(sorted_x: torch.Tensor, fraction: float) -> float:
    """llama.cpp's ``percentile``: linear interpolation at ``fraction * (n - 1)`` of sorted values."""
    n = sorted_x.numel()
    p = fraction * (n - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_x[i] + p * sorted_x[min(i + 1, n - 1)])


def _median(sorted_x: torch.Tensor) -> float:
    n = sorted_x.numel()
    return float(sorted_x[n // 2]) if n % 2 else float(0.5 * (sorted_x[n // 2] + sorted_x[n // 2 - 1]))


def summarize(s: TokenStats) -> dict:
    """The report's statistics of :class:`TokenStats` (module docstring), llama.cpp's formulas.

    Returns:
        ``{"ppl_src", "ppl_out", "ppl_ratio", "ln_ppl_ratio", "ppl_correlation", "kld": {"mean",
        "median", "p90", "p99", "p999", "max", "min"}, "top1_agreement", "rms_dp", "mean_dp",
        "max_abs_dp", "tokens", "uncertainty": {"ppl_src", "ppl_out", "ppl_ratio", "ln_ppl_ratio",
        "kld_mean", "top1_agreement", "rms_dp", "mean_dp"}}``; floats, nats for KLD.

    Raises:
        G4Error: no scored token.
    """
    n = s.kld.numel()
    if n == 0:
        raise G4Error("no token was scored: give more text, or a larger --max-tokens than --ctx")
    m_src, se_src = _mean_se(s.nll_src)
    m_out, se_out = _mean_se(s.nll_out)
    cov = (float((s.nll_src * s.nll_out).sum()) / n - m_src * m_out) / (n - 1) if n >= 10 else 0.0
    ln_ratio = m_out - m_src
    se_ln_ratio = math.sqrt(max(se_out ** 2 + se_src ** 2 - 2 * cov, 0.0))
    ppl_src, ppl_out, ratio = math.exp(m_src), math.exp(m_out), math.exp(ln_ratio)
    kld_sorted = torch.sort(s.kld).values
    kld_mean, kld_se = _mean_se(s.kld)
    top1 = float(s.same_top.double().mean())
    mse, mse_se = _mean_se(s.dp * s.dp)
    rms = math.sqrt(mse)
    mean_dp, mean_dp_se = _mean_se(s.dp)
    return {
        "ppl_src": ppl_src, "ppl_out": ppl_out, "ppl_ratio": ratio, "ln_ppl_ratio": ln_ratio,
        "ppl_correlation": cov / (se_out * se_src) if se_out > 0 and se_src > 0 else None,
        "kld": {"mean": kld_mean, "median": _median(kld_sorted),
                **{k: _percentile(kld_sorted, f) for k, f in KLD_PERCENTILES.items()},
                "max": float(kld_sorted[-1]), "min": float(kld_sorted[0])},
        "top1_agreement": top1, "rms_dp": rms, "mean_dp": mean_dp, "max_abs_dp": float(s.dp.abs().max()),
        "tokens": n,
        "uncertainty": {"ppl_src": ppl_src * se_src, "ppl_out": ppl_out * se_out, "ppl_ratio": ratio * se_ln_ratio,
                        "ln_ppl_ratio": se_ln_ratio, "kld_mean": kld_se,
                        "top1_agreement": math.sqrt(top1 * (1 - top1) / (n - 1)) if n > 1 else 0.0,
                        "rms_dp": 0.5 / rms * mse_se if rms > 0 else 0.0, "mean_dp": mean_dp_se},
    }


# --------------------------------------------------------------------------- text and chunks


def eval_chunks(tokenizer, docs: list[str], *, ctx: int, max_tokens: int, text_name: str) -> tuple[torch.Tensor, int]:
    """Tokenize ``docs`` (each with the tokenizer's ``<bos>``) into one stream and cut its first
    ``max_tokens`` into ``[n, ctx]`` chunks, the first token of each replaced by ``<bos>``.

    Returns:
        ``(int64 [n, ctx] chunks, tokens in the stream read)``.

    Raises:
        G4Error: the text (or ``max_tokens``) holds fewer than ``ctx`` tokens, or the tokenizer has
            no ``<bos>``.
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        raise G4Error("the source's tokenizer has no <bos> token; eval starts every chunk with it")
    stream: list[int] = []
    for doc in docs:
        stream.extend(tokenizer(doc, add_special_tokens=True, verbose=False)["input_ids"])
        if len(stream) >= max_tokens:
            break
    n = min(len(stream), max_tokens) // ctx
    if n == 0:
        raise G4Error(f"{text_name}: {min(len(stream), max_tokens)} tokens (of --max-tokens {max_tokens}), fewer than "
                      f"one chunk of --ctx {ctx}; give more text or a smaller --ctx")
    chunks = torch.tensor(stream[: n * ctx], dtype=torch.int64).reshape(n, ctx)
    chunks[:, 0] = bos
    return chunks, len(stream)


# --------------------------------------------------------------------------- the two models


def eval_device(name: str) -> torch.device:
    """``auto``: CUDA where torch sees it, else the CPU (:func:`g4.convert.calibrate.calibration_device`'s
    rule and checks, under the name ``--device``).

    Raises:
        OptionError: an unknown device or a CUDA device torch does not see.
    """
    try:
        return calibration_device(name)
    except G4Error as e:
        raise OptionError(str(e).replace("--calib-device", "--device")) from None


def open_result(out: Path, src: Path, *, act_quant: bool | None, dtype: torch.dtype, device: torch.device):
    """OUT as a layer-streamed model, after checking it against its format's table and SRC.

    ``act_quant`` (NVFP4): None = W4A4 emulation exactly when OUT has ``input_scale``s (as vLLM
    on Blackwell computes it, and ``verify``); False = weight-only arithmetic (W4A16).

    Returns:
        ``(StreamedModel, ResultFormat, act_quant used)``.

    Raises:
        G4Error: OUT differs from its table, its config is not SRC's, or ``act_quant`` was asked of
            a result without ``input_scale``s or of another format.
    """

    fmt = check_result(out)  # headers against the format's table before anything trusts OUT
    check_converted_from(out, src)  # the rule verify and g4serve check apply
    if act_quant and not fmt.w4a4:
        raise G4Error(f"{out}: --act-quant needs an NVFP4 W4A4 result (input_scale tensors); this is {fmt.detail}")
    if fmt.format == NVFP4:
        use = fmt.w4a4 if act_quant is None else act_quant
        return Nvfp4Stream(out, dtype, act_quant=use, device=device), fmt, use
    if fmt.format == INT8_NEURON:
        return Int8NeuronStream(out, dtype, device=device), fmt, False
    assert fmt.format == BF16
    return SourceStream(out, dtype, device=device), fmt, False


def _batches(n: int, ctx: int) -> list[slice]:
    """Chunks run through a layer together: at most :data:`MAX_TOKENS_PER_FORWARD` tokens a batch."""
    per = max(1, MAX_TOKENS_PER_FORWARD // ctx)
    return [slice(i, min(i + per, n)) for i in range(0, n, per)]


@torch.no_grad()
def final_hidden(model, chunks: torch.Tensor, *, on_step=None) -> torch.Tensor:
    """The last decoder layer's output over ``chunks`` (int64 ``[n, ctx]``, each from an empty
    context): ``[n, ctx, H]`` in the model's compute dtype, on its device, one decoder layer in RAM
    at a time (batches of :data:`MAX_TOKENS_PER_FORWARD` tokens). ``on_step``: called after each layer."""
    n, ctx = chunks.shape
    batches = _batches(n, ctx)
    hidden = [model.embed(chunks[b].reshape(-1)).reshape(b.stop - b.start, ctx, -1) for b in batches]
    pos = model.rope.positions(hidden[0][:1], 0)  # every chunk starts at position 0: one set for all
    for layer in range(model.num_layers):
        module = model.layer(layer)
        hidden = [run_layer(module, layer, h, pos) for h in hidden]
        del module
        if on_step:
            on_step()
    return torch.cat(hidden) if len(hidden) > 1 else hidden[0]


@torch.no_grad()
def compare_on_chunks(src, res, chunks: torch.Tensor, *, on_step=None, timings: dict | None = None,
                      src_hidden: torch.Tensor | None = None) -> TokenStats:
    """Teacher-force both streamed models over ``chunks`` (int64 ``[n, ctx]``) one decoder layer
    at a time (SRC's layers over every chunk, then OUT's), then the two heads, one chunk at a
    time, over the scored positions only (the second half of each chunk, module docstring).

    Memory: both sides' hidden states ``[n, ctx, H]`` in the compute dtype, one layer, and in
    the head phase the ``[V, H]`` heads (one when both sides' are equal, as for a tied NVFP4
    result, whose embedding stays bf16) and ``[HEAD_ROWS, V]`` fp32 log-prob blocks.

    Args:
        on_step: called after each layer of each side and after the heads (a progress bar).
        timings: filled with ``{"layer_seconds", "head_seconds"}`` (wall seconds of the two phases).
        src_hidden: SRC's :func:`final_hidden` over ``chunks`` where already known (eval's entry in
            :class:`g4.convert.stream.SourceSideCache`): SRC's decoder layers are then not run (nor read).

    Returns:
        :class:`TokenStats` of the ``n * (ctx - 1 - ctx // 2)`` scored tokens, chunk order.
    """
    t0 = time.perf_counter()
    n, ctx = chunks.shape
    first = ctx // 2
    if src_hidden is None:
        src_hidden = final_hidden(src, chunks, on_step=on_step)
    h_src, h_res = src_hidden.to(src.device), final_hidden(res, chunks, on_step=on_step)
    t1 = time.perf_counter()
    w_src = src.head_weights()
    if res.head_equals(w_src[1]):  # one [V, H] head in RAM, never two copies of the same bytes (compared from the file)
        w_res = (res.final_norm_weight(), w_src[1])
    else:
        w_res = res.head_weights()
    head_src, head_res = src._head(*w_src), res._head(*w_res)
    del w_src, w_res
    parts = []
    for c in range(n):
        for r in range(first, ctx - 1, HEAD_ROWS):
            rows = slice(r, min(r + HEAD_ROWS, ctx - 1))
            lp = torch.log_softmax(head_src(h_src[c : c + 1, rows]).float()[0], -1)
            lq = torch.log_softmax(head_res(h_res[c : c + 1, rows]).float()[0], -1)
            parts.append(token_stats(lp, lq, chunks[c, rows.start + 1 : rows.stop + 1]))
            del lp, lq
    if on_step:
        on_step()
    if timings is not None:
        timings.update(layer_seconds=round(t1 - t0, 3), head_seconds=round(time.perf_counter() - t1, 3))
    return TokenStats.cat(parts)


# --------------------------------------------------------------------------- the report


def source_identity(src: Path, known: dict[str, dict] | None = None, hashed: dict[str, dict] | None = None) -> dict:
    """How eval.json names SRC without a local path: ``embedded``, or the Hub repo id and commit
    of a Hugging Face cache snapshot, or the directory's name with the size and sha256 of every
    weight file (``known``, ``hashed``: records of files hashed before and now,
    :func:`g4.core.checkpoint.weight_fingerprints`)."""
    if src.resolve() == EMBEDDED_DIR.resolve():
        return {"name": "embedded", "weight_files": weight_fingerprints(src, known, hashed)}
    repo, revision = hf_cache_repo_id(src), hf_cache_revision(src)
    if repo and revision:
        return {"repo_id": repo, "revision": revision}
    return {"name": src.resolve().name, "weight_files": weight_fingerprints(src, known, hashed)}


def _text_identity(text: Path | None, docs: list[str], stream_tokens: int) -> dict:
    path = Path(text) if text is not None else DEFAULT_TEXT_FILE
    return {"file": path.name, "packaged": text is None, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "documents": len(docs), "tokens_read": stream_tokens}


def write_eval(out: Path, report: dict) -> Path:
    """``OUT/eval.json``, atomically (:func:`g4.exporters.output_dir.write_text_atomic`)."""
    return write_text_atomic(out / EVAL_FILE, json.dumps(report, indent=2) + "\n", placed=True)


def evaluate(out: str | Path, src: str | Path, *, text: str | Path | None = None,
             max_tokens: int = DEFAULT_MAX_TOKENS, ctx: int = DEFAULT_CTX, act_quant: bool | None = None,
             dtype: torch.dtype = torch.bfloat16, device: str = "auto", progress: bool = False,
             write: bool = True) -> dict:
    """Evaluate the result ``out`` against its source ``src`` on held-out text and write
    ``out/eval.json`` (then re-render OUT's model card when OUT is a g4 result).

    Args:
        out: an NVFP4 (W4A4 or W4A16), int8-neuron or bf16 checkpoint with SRC's config.
        src: the source checkpoint (``Checkpoint(source=True)`` rules: not quantized).
        text: ``.jsonl`` (``text`` or chat ``messages`` records) or plain text (documents
            separated by blank lines); default :data:`DEFAULT_TEXT_FILE`, never used for
            calibration or training.
        max_tokens: tokens of the text evaluated at most (cut into chunks of ``ctx``).
        ctx: chunk length in tokens (llama.cpp's ``-c``); the second half of each is scored.
        act_quant: NVFP4 W4A4 emulation (:func:`open_result`).
        dtype: compute dtype (weights cast one layer at a time).
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.
        write: write ``eval.json`` (and the card).

    Returns:
        The report (the ``eval.json`` object): :func:`summarize`'s statistics plus
        ``g4_eval``, ``format``, ``act_quant``, ``against`` (:func:`source_identity`), ``text``,
        ``ctx``, ``chunks``, ``scored``, ``dtype``, ``device``, ``src_hidden_from_cache`` (SRC's
        side from :class:`g4.convert.stream.SourceSideCache`: none of SRC's decoder layers read), ``seconds`` (all), ``layer_seconds`` and
        ``head_seconds`` (the two phases), ``files`` (size and
        sha256 of OUT's weight files, so a card can tell a stale evaluation).

    Raises:
        G4Error: unreadable text, too few tokens, ``ctx`` above the model's
            ``max_position_embeddings``, an unwritable OUT, or OUT/SRC problems
            (:func:`open_result`, :class:`g4.convert.stream.SourceStream`).
    """
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    out, src = Path(out), Path(src)
    on = eval_device(device)
    if write and not os.access(out, os.W_OK):
        raise G4Error(f"{out}: not writable; eval writes {EVAL_FILE} there")
    src_model = SourceStream(src, dtype, device=on)
    res_model, fmt, act_quant = open_result(out, src, act_quant=act_quant, dtype=dtype, device=on)
    max_pos = getattr(src_model.config, "max_position_embeddings", None)
    if max_pos and ctx > max_pos:
        raise OptionError(f"--ctx {ctx} exceeds the model's max_position_embeddings {max_pos}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception as e:  # many exception types for a missing or broken tokenizer
        raise CheckpointError(f"{src}: eval needs the source's tokenizer and it cannot be loaded "
                              f"({type(e).__name__})") from e
    docs = read_calibration_texts(text, tokenizer, what="evaluation", default=DEFAULT_TEXT_FILE, option="--text")
    chunks, stream_tokens = eval_chunks(tokenizer, docs, ctx=ctx, max_tokens=max_tokens,
                                        text_name=str(text or DEFAULT_TEXT_FILE.name))
    # SRC's side of an earlier eval on the same tokens: its last layer's output and its provenance
    cache = SourceSideCache("eval", src_model, {"chunks": chunks})
    hit = cache.load({_HIDDEN: (*chunks.shape, src_model.config.hidden_size)})
    cached = hit is not None
    steps = (1 if cached else 2) * src_model.num_layers + 1
    with cache.reading(src, "eval"), progress_bar(steps, f"eval {out.name}", enabled=progress, unit="step") as bar:
        timings: dict = {}
        if hit is None:
            t1 = time.perf_counter()
            src_hidden = final_hidden(src_model, chunks, on_step=lambda: bar.update(1))
            hashed: dict = {}
            against = source_identity(src, hashed=hashed)
            cache.check_unchanged(src, "eval")  # SRC's side is whole and of one SRC: kept
            cache.save({_HIDDEN: src_hidden}, {"sha256": hashed})
            timings_src = time.perf_counter() - t1
        else:
            (tensors, kept), timings_src = hit, 0.0
            src_hidden = tensors[_HIDDEN]
            # named afresh (another folder name or Hub revision of the same files is another SRC);
            # a weight file unchanged since it was hashed is not read again
            against = source_identity(src, kept.get("sha256") if isinstance(kept.get("sha256"), dict) else None)
        stats = compare_on_chunks(src_model, res_model, chunks, on_step=lambda: bar.update(1), timings=timings,
                                  src_hidden=src_hidden)
        # after every read of SRC (its head's too) and its hashes: the report names the bytes it came from
        cache.check_unchanged(src, "eval")
        timings["layer_seconds"] = round(timings["layer_seconds"] + timings_src, 3)
    report = {"g4_eval": EVAL_VERSION, "format": fmt.format, "detail": fmt.detail, "act_quant": act_quant,
              **summarize(stats),
              "against": against, "text": _text_identity(text, docs, stream_tokens),
              "ctx": ctx, "chunks": int(chunks.shape[0]),
              "scored": f"the second half of each chunk (positions {ctx // 2}..{ctx - 2} predict tokens "
                        f"{ctx // 2 + 1}..{ctx - 1}), as llama.cpp perplexity",
              "dtype": str(dtype).removeprefix("torch."), "device": on.type,
              "src_hidden_from_cache": cached,
              "seconds": round(time.perf_counter() - t0, 3), **timings}
    if write:
        report["files"] = weight_fingerprints(out)  # int8-neuron: the rank files and the host table
        write_eval(out, report)
        rerender_card(out)
    return report


def summary(report: dict) -> str:
    """The report as llama.cpp prints its statistics (± one standard error)."""
    u, k = report["uncertainty"], report["kld"]
    what = f"{report['detail']}" + (", W4A4 emulation" if report["act_quant"] else "")
    lines = [f"{report['tokens']} tokens scored ({report['chunks']} chunks of {report['ctx']}, second halves) "
             f"of {report['text']['file']}; {what}; {report['dtype']} on {report['device']}, {report['seconds']:.1f} s",
             f"PPL(SRC)          {report['ppl_src']:10.4f} ± {u['ppl_src']:.4f}",
             f"PPL(OUT)          {report['ppl_out']:10.4f} ± {u['ppl_out']:.4f}",
             f"PPL(OUT)/PPL(SRC) {report['ppl_ratio']:10.6f} ± {u['ppl_ratio']:.6f}",
             f"mean KLD          {k['mean']:10.6f} ± {u['kld_mean']:.6f}",
             f"median KLD        {k['median']:10.6f}",
             f"90% KLD           {k['p90']:10.6f}",
             f"99% KLD           {k['p99']:10.6f}",
             f"99.9% KLD         {k['p999']:10.6f}",
             f"max KLD           {k['max']:10.6f}",
             f"same top p        {100 * report['top1_agreement']:9.3f} ± {100 * u['top1_agreement']:.3f} %",
             f"RMS dp            {100 * report['rms_dp']:9.3f} ± {100 * u['rms_dp']:.3f} %"]
    return "\n".join(lines)
