"""``g4convert verify``: an NVFP4 result against its source on held-out prompts.

Source and result run one decoder layer at a time (:mod:`g4.convert.stream`), so the 26B
verifies in about one layer of RAM beside the head; the figures are
:func:`g4.convert.reference.compare_logprobs`'s (greedy token agreement, KL of next-token
distributions), and the source's facts (``facts.json``) are asked of the result.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from g4.convert.reference import chat_prompt_ids
from g4.convert.stream import (
    Nvfp4Stream,
    SourceSideCache,
    SourceStream,
    compare_streamed,
    source_side,
    source_side_shapes,
    streamed_greedy,
)
from g4.core.checkpoint import check_converted_from
from g4.core.errors import CheckpointError
from g4.core.progress import progress_bar
from g4.exporters.formats import INT8_NEURON, NVFP4, detect_format

# Generic held-out prompts for sources that ship no facts.json.
DEFAULT_PROMPTS = (
    "Write one sentence about the sea.",
    "What is the capital of Canada?",
    "List three colours.",
    "Explain what a verb is.",
    "How many legs does a spider have?",
    "Say hello in French.",
    "What do bees make?",
    "Name a large animal.",
)


@dataclass
class VerifyReport:
    """Agreement of a converted model with its source.

    ``token_agreement``: fraction of teacher-forced positions (the source's greedy
    continuation of each prompt) where both models' argmax agree. ``mean_kl``: mean
    KL(source || converted) in nats over the same positions. ``all_*``: the same over
    every position of prompt plus continuation (prompt positions are text the model
    did not choose, so these are lower and only reported). ``layer_rel_error``: per
    decoder layer, ``||h_converted - h_source|| / ||h_source||`` of its output hidden
    states over the continuation positions (:func:`g4.convert.stream.compare_streamed`):
    where along the model the result drifts. ``src_side_from_cache``: the source's continuations
    and hidden states came from an earlier verify on the same prompts
    (:class:`g4.convert.stream.SourceSideCache`): none of its decoder layers were read.
    """

    prompts: int
    positions: int
    token_agreement: float
    mean_kl: float
    all_positions: int
    all_token_agreement: float
    all_mean_kl: float
    act_quant: bool
    facts_total: int = 0
    facts_correct: int = 0
    answers: list[dict] = field(default_factory=list)
    layer_rel_error: list[float] = field(default_factory=list)
    src_side_from_cache: bool = False

    def failures(self, min_agreement: float) -> list[str]:
        """Why the check fails at ``min_agreement`` (empty when it passes)."""
        why = []
        if self.token_agreement < min_agreement:
            why.append(f"token agreement {self.token_agreement:.3f} < {min_agreement}")
        if self.facts_correct != self.facts_total:
            why.append(f"{self.facts_total - self.facts_correct} fact(s) answered wrong")
        return why

    def summary(self) -> str:
        lines = [f"token agreement {self.token_agreement:.3f} over {self.positions} positions of {self.prompts} "
                 f"held-out prompts; mean KL {self.mean_kl:.4f} nats ({'W4A4' if self.act_quant else 'W4A16'} emulation)",
                 f"all {self.all_positions} positions incl. prompts: agreement {self.all_token_agreement:.3f}, "
                 f"mean KL {self.all_mean_kl:.4f} nats"]
        if self.layer_rel_error:
            lines.append("hidden-state relative error per layer: "
                         + " ".join(f"{i}:{e:.4f}" for i, e in enumerate(self.layer_rel_error)))
        if self.facts_total:
            lines.append(f"facts answered: {self.facts_correct}/{self.facts_total}")
            lines += [f"  {'ok ' if a['ok'] else 'BAD'} {a['question']!r} -> {a['reply']!r} (expected {a['answer']!r})"
                      for a in self.answers]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


SOURCE_FACTS = "facts.json"  # a source's held-out prompts, facts and tool calls (the embedded model ships one)


def read_source_facts(src: str | Path) -> tuple[list[tuple[str, str]], list[str], dict] | None:
    """``SRC/facts.json`` read and checked, or None when SRC has none.

    Returns:
        ``([(question, answer)], heldout prompts, the whole object)``: ``facts`` (``[{"question",
        "answer"}]``, may be absent), ``heldout`` (``[str]``, may be absent) and whatever else it holds
        (``tool_calls``: :func:`g4.serve.check.load_tool_cases`).

    Raises:
        CheckpointError: the file is unreadable, not a JSON object, or ``facts`` / ``heldout`` are not
            of that shape (named).
    """
    path = Path(src) / SOURCE_FACTS
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must be a JSON object")
    facts, heldout = data.get("facts", []), data.get("heldout", [])
    if not (isinstance(facts, list) and all(isinstance(f, dict) and isinstance(f.get("question"), str)
                                            and f["question"].strip() and isinstance(f.get("answer"), str)
                                            for f in facts)):
        raise CheckpointError(f"{path}: 'facts' must be a list of {{\"question\": str, \"answer\": str}} objects")
    if not (isinstance(heldout, list) and all(isinstance(h, str) and h.strip() for h in heldout)):
        raise CheckpointError(f"{path}: 'heldout' must be a list of non-empty strings")
    return [(f["question"], f["answer"]) for f in facts], list(heldout), data


def _check_pair(out: Path, src: Path, act_quant: bool | None) -> bool:
    """OUT must be a modelopt NVFP4 checkpoint converted from SRC (same config otherwise).

    Returns:
        whether to emulate W4A4: ``act_quant``, or when None, whether OUT is W4A4 (the
        rule of ``g4.serve.engine.load_cpu_engine``, so verify and ``g4serve check`` agree).
    """
    fmt = detect_format(out)
    if fmt.format == INT8_NEURON:
        raise CheckpointError(f"{out}: an int8-neuron result; verify checks NVFP4 results, int8-neuron results are "
                              f"checked with `g4serve check {out} --against SRC`")
    if fmt.format != NVFP4:
        raise CheckpointError(f"{out}: not a modelopt NVFP4 checkpoint (config.json has no NVFP4 quantization_config)")
    check_converted_from(out, src)
    if act_quant and not fmt.w4a4:
        raise CheckpointError(f"{out}: --act-quant needs input_scale tensors, and this is a weight-only (W4A16) checkpoint")
    return fmt.w4a4 if act_quant is None else act_quant


ANSWER_TOKENS = 8  # greedy tokens of a reply to a fact question; the expected answer must start it


def eos_token_ids(root: Path) -> list[int]:
    """The ids ``generate`` stops at for the checkpoint in ``root``: ``generation_config.json``'s
    ``eos_token_id`` (int or list), else the config's, as transformers' ``GenerationConfig``
    reads them."""
    from transformers import AutoConfig, GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(root)
    except OSError:  # no generation_config.json: transformers derives it from config.json
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(root))
    eos = gen.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _kept_continuations(kept: dict, prompts: int, max_new_tokens: int, vocab: int) -> list[list[int]]:
    """The SRC continuations a :class:`SourceSideCache` entry kept.

    Raises:
        ValueError: not one list of at most ``max_new_tokens`` token ids (ints in ``[0, vocab)``)
            per prompt.
    """
    continuations = kept["continuations"]
    if not (isinstance(continuations, list) and len(continuations) == prompts and all(
            isinstance(c, list) and len(c) <= max_new_tokens and all(type(t) is int and 0 <= t < vocab for t in c)
            for c in continuations)):
        raise ValueError("not the continuations of these prompts")
    return continuations


def verify_nvfp4(out: str | Path, src: str | Path, *, max_new_tokens: int = 16, act_quant: bool | None = None,
                 dtype: torch.dtype = torch.bfloat16, progress: bool = False) -> VerifyReport:
    """Compare the NVFP4 checkpoint ``out`` with its source ``src`` on held-out prompts.

    ``act_quant``: emulate W4A4 activation quantization with OUT's ``input_scale``s; None
    (default) = exactly when OUT is W4A4, as ``g4serve check`` and vLLM on Blackwell compute.
    ``progress``: a bar on stderr counting decoder layers run (each generated token is one pass
    over SRC's layers, the comparison one pass over both models', each fact's answer token one
    pass over OUT's), with the phase it is in.

    Prompts come from ``src/facts.json`` (``heldout``, when it has any; the embedded model ships
    one) or :data:`DEFAULT_PROMPTS`; the facts in that file are also asked of the converted model
    (:func:`read_source_facts`).

    SRC's continuations and hidden states are kept (:class:`g4.convert.stream.SourceSideCache`,
    ``G4_SOURCE_CACHE``): a later verify against the same SRC with the same prompts and
    ``max_new_tokens`` reads only SRC's head, not its decoder layers once per new token.

    Raises:
        CheckpointError: unreadable source/output, tensors that do not fit the model, a
            malformed ``src/facts.json``, or a SRC weight file that changed (rewritten, replaced,
            relinked) while verify read it (:meth:`g4.convert.stream.SourceSideCache.changed`).
    """
    from transformers import AutoTokenizer

    out, src = Path(out), Path(src)
    act_quant = _check_pair(out, src, act_quant)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception as e:  # many exception types for a missing or broken tokenizer
        raise CheckpointError(f"{src}: verify needs the source's tokenizer and it cannot be loaded "
                              f"({type(e).__name__})") from e
    src_model = SourceStream(src, dtype)
    q_model = Nvfp4Stream(out, dtype, act_quant=act_quant)
    facts, prompts = [], list(DEFAULT_PROMPTS)
    read = read_source_facts(src)
    if read is not None:
        facts, prompts = read[0], read[1] or prompts
    prompt_ids = [chat_prompt_ids(tokenizer, p)[0].tolist() for p in prompts]
    layers = src_model.num_layers
    src_eos = eos_token_ids(src)
    # SRC's side of an earlier verify on the same prompts: its continuations and hidden states
    cache = SourceSideCache("verify", src_model, {"prompts": prompt_ids, "max_new_tokens": max_new_tokens,
                                                  "eos": src_eos})
    def kept_shapes(kept: dict) -> dict:
        continuations = _kept_continuations(kept, len(prompt_ids), max_new_tokens, src_model.config.vocab_size)
        return source_side_shapes(src_model, [p + c for p, c in zip(prompt_ids, continuations)],
                                  [len(p) for p in prompt_ids])

    hit = cache.load(kept_shapes)
    phases = [("comparing", layers)] if hit else [("SRC greedy", max_new_tokens * layers), ("comparing", 2 * layers)]
    phases += [("facts", ANSWER_TOKENS * layers)] if facts else []
    with cache.reading(src, "verify"), progress_bar(sum(n for _, n in phases), f"verify {out.name}",
                                                    enabled=progress, unit="layer") as bar:
        src_model.on_layer = q_model.on_layer = lambda: bar.update(1)
        ends = iter(itertools.accumulate(n for _, n in phases))

        def phase(name: str) -> None:
            if bar.n:  # a phase that ended early (every prompt reached EOS) moves the bar to its end
                bar.update(next(ends) - bar.n)
            bar.set_postfix_str(name)

        lengths = [len(p) for p in prompt_ids]
        if hit is None:
            phase("SRC greedy")
            continuations = streamed_greedy(src_model, prompt_ids, max_new_tokens=max_new_tokens,
                                            eos_token_ids=src_eos)
            phase("comparing")
            sequences = [p + c for p, c in zip(prompt_ids, continuations)]
            side = source_side(src_model, sequences, lengths)
            cache.check_unchanged(src, "verify")  # SRC's side is whole and of one SRC: kept
            cache.save(side, {"continuations": continuations})
        else:
            phase("comparing")
            side, kept = hit
            sequences = [p + c for p, c in zip(prompt_ids, kept["continuations"])]
        stats = compare_streamed(src_model, q_model, sequences, lengths, src_side=side)
        # after every read of SRC (its head's too): the figures are of one SRC, not of two files
        cache.check_unchanged(src, "verify")
        report = VerifyReport(prompts=len(prompts), act_quant=act_quant, src_side_from_cache=hit is not None, **stats)
        questions = [chat_prompt_ids(tokenizer, q)[0].tolist() for q, _ in facts]
        if facts:
            phase("facts")
        replies = streamed_greedy(q_model, questions, max_new_tokens=ANSWER_TOKENS, eos_token_ids=eos_token_ids(out))
        bar.update(bar.total - bar.n)
    for (question, expected), ids in zip(facts, replies):
        reply = tokenizer.decode(ids, skip_special_tokens=True).strip()
        ok = reply.startswith(expected)
        report.answers.append({"question": question, "answer": expected, "reply": reply, "ok": ok})
        report.facts_correct += ok
    report.facts_total = len(facts)
    return report
