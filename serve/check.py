"""``g4serve check``: serve a result, talk to it as any OpenAI client would, and compare its
greedy replies with the source model's in transformers.

What is measured (all through ``/v1/chat/completions`` with the ``openai`` client package):

* **token agreement** per prompt: the served greedy ids (``choices[0].token_ids``, which g4's
  server and vLLM's ``return_token_ids`` return; otherwise the reply re-tokenized with the
  source tokenizer, and then the reference too) against SRC's greedy ids (transformers' Gemma 4
  layers run one at a time, :func:`reference_replies`) with the same chat template and budget. A stop id at the end of either sequence counts as one
  "stop" position (whatever stop id it was). Agreement = positions ``i`` below the shorter
  length where both ids are equal, divided by the longer length (so a reply that stops early
  or runs on is penalised); overall = the same sums over all prompts. ``first_divergence``:
  the first position where they differ (``None`` when identical).
* **facts** (when SRC ships ``facts.json``, as the embedded model does): each question asked
  greedily; right when the reply starts with the answer.
* **tool calls** (when ``SRC/facts.json`` has ``tool_calls``, as the embedded model's does):
  each question asked greedily with its tools declared; right when the reply is exactly the
  expected call (``finish_reason: "tool_calls"``, the function's name, the arguments equal as
  JSON), read from the OpenAI ``tool_calls`` the server parsed.
* **P13 chat checks** (vllm-project/vllm issues #39885, #49717, PR #38858): one arithmetic question with thinking
  off and on (``chat_template_kwargs.enable_thinking``), each streamed and not: ``content``
  non-empty, containing the answer and no ``<|channel>``, ``<channel|>``, ``<turn|>`` or
  ``<|think|>`` text; streamed content equal to non-streamed; every combination reported.

Each prompt's ``held_out`` (a ``held-out`` tag in the printed rows): true for ``SRC/facts.json``'s
``heldout`` prompts (the model never saw them) and for the built-in prompts, none of which the
calibration text g4 ships contains (a test checks); false for the fact questions (the model was
trained on them); null for a ``--prompts`` file (g4 cannot know).

The report is written to ``OUT/verification.json`` (atomically; no timestamps, so the same
inputs render the same model card). Schema (``g4_verification: 1``)::

    {"g4_verification": 1, "format": "nvfp4"|"int8-neuron"|"bf16", "backend": "cpu"|"vllm"|"neuron",
     "engine": str|null (g4 server: e.g. "NVFP4 W4A4 (modelopt) dequantized, W4A4 activation emulation,
     bfloat16"; null for other servers), "source": str, "min_agreement": float, "passed": bool, "failures": [str],
     "overall": {"prompts", "token_agreement", "exact_match_prompts", "facts_correct", "facts_total",
                 "tool_calls_correct", "tool_calls_total",
                 "token_ids_from": "server"|"retokenized", "max_tokens"},
     "prompts": [{"prompt", "held_out", "token_agreement", "first_divergence", "reply", "reference_reply"}],
     "facts": [{"question", "answer", "reply", "ok"}],
     "tool_calls": [{"question", "expected": {"name", "arguments"}, "calls": [{"name", "arguments"}],
                     "content", "finish_reason", "ok"}],
     "chat_checks": [{"thinking", "stream", "ok", "content", "problem"}]}
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from g4.convert.card import describe_calls, rerender_card, source_label as pushable_source_label
from g4.convert.options import text_file_suffix
from g4.convert.stream import SourceStream, streamed_greedy
from g4.convert.verify import DEFAULT_PROMPTS, SOURCE_FACTS, read_source_facts
from g4.core.checkpoint import (CONFIG_NAME, Checkpoint, FileRecords, check_converted_from, read_json_object,
                                weight_fingerprints)
from g4.core.errors import CheckpointError, G4Error, a_or_an
from g4.exporters.formats import VERIFICATION_FILE, ResultFormat, check_result, detect_format
from g4.exporters.output_dir import write_text_atomic
from g4.serve.backends import choose_backend
from g4.serve.chat import ChatError, ControlIds, ReplyParser, control_text_in, openai_tools, render_prompt
from g4.serve.engine import Engine, load_cpu_engine, load_tokenizer, max_context, served_file_stats
from g4.serve.neuron_backend import load_neuron_engine
from g4.serve.server import BackgroundServer, create_app
from g4.serve.vllm_backend import VllmServer

STOP = -1  # one "stopped here" position, whatever the stop id
P13_QUESTION, P13_ANSWER = "What is 2+2?", "4"


def agreement(served: list[int], reference: list[int]) -> tuple[float, int | None, int, int]:
    """Greedy token agreement of two id sequences.

    Returns:
        ``(agreement in [0, 1], first divergence index or None, matches, positions)`` where
        ``positions = max(len)`` and matches are counted below ``min(len)``.
    """
    n = max(len(served), len(reference))
    if n == 0:
        return 1.0, None, 0, 0
    matches = sum(a == b for a, b in zip(served, reference))
    first = next((i for i in range(n) if i >= len(served) or i >= len(reference) or served[i] != reference[i]), None)
    return matches / n, first, matches, n


def normalise_ids(ids: list[int], stop_ids: frozenset[int], stopped: bool) -> list[int]:
    """Ids with a final stop id (or a stop the server did not return as an id) as :data:`STOP`."""
    ids = list(ids)
    if ids and ids[-1] in stop_ids:
        ids[-1] = STOP
    elif stopped:
        ids.append(STOP)
    return ids


def check_prompts_file(path: Path) -> str:
    """How :func:`load_prompts` reads ``path``: ``".txt"`` or ``".jsonl"``.

    Raises:
        OptionError: any other suffix (:func:`g4.convert.options.text_file_suffix`).
    """
    return text_file_suffix(path, "--prompts", "one prompt per line", '{"prompt": ...} per line')


def load_prompts(prompts_file: Path | None, src: Path
                 ) -> tuple[list[str], list[tuple[str, str]], list[str], list[bool | None]]:
    """The prompt set, the facts and where each prompt came from.

    ``prompts_file``: ``.txt`` (one prompt per non-empty line) or ``.jsonl`` (``{"prompt": str}``
    per line). Without it: every prompt ``SRC/facts.json`` ships (the fact questions, then the
    ``heldout`` prompts the model never saw), else the built-in
    :data:`g4.convert.verify.DEFAULT_PROMPTS`. Facts: ``SRC/facts.json`` ``facts`` (else none).

    Returns:
        ``(prompts, [(question, answer)], labels, held_out)``; ``labels[i]`` says where prompt
        ``i`` came from, for error messages: ``"FILE line 7"`` (the line number in the file, blank
        lines counted), ``"SRC/facts.json"`` or ``"built-in"``; ``held_out[i]`` whether it is
        held out (see the module docstring: None for a prompts file).

    Raises:
        OptionError: a prompts file whose suffix is neither ``.txt`` nor ``.jsonl``.
        G4Error: an unreadable or empty prompts file, or a malformed line; a malformed
            ``SRC/facts.json`` (:func:`g4.convert.verify.read_source_facts`).
    """
    facts: list[tuple[str, str]] = []
    prompts = list(DEFAULT_PROMPTS)
    labels = ["built-in"] * len(prompts)
    held_out: list[bool | None] = [True] * len(prompts)
    read = read_source_facts(src)
    if read is not None:
        facts, heldout, _ = read
        if facts or heldout:  # a facts.json with tool calls only: the built-in prompts
            prompts = [q for q, _ in facts] + heldout
            labels = [str(src / SOURCE_FACTS)] * len(prompts)
            held_out = [False] * len(facts) + [True] * len(heldout)
    if prompts_file is not None:
        suffix = check_prompts_file(prompts_file)
        try:
            numbered = [(n, ln) for n, ln in enumerate(Path(prompts_file).read_text().splitlines(), 1) if ln.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise G4Error(f"{prompts_file}: cannot read prompts ({type(e).__name__})") from e
        lines = [ln for _, ln in numbered]
        labels = [f"{prompts_file} line {n}" for n, _ in numbered]
        held_out = [None] * len(numbered)
        if suffix == ".jsonl":
            try:
                prompts = [json.loads(ln)["prompt"] for ln in lines]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise G4Error(f"{prompts_file}: each line must be a JSON object with a 'prompt' string") from e
            if not all(isinstance(p, str) and p.strip() for p in prompts):
                raise G4Error(f"{prompts_file}: each 'prompt' must be a non-empty string")
        else:
            prompts = [ln.strip() for ln in lines]
        if not prompts:
            raise G4Error(f"{prompts_file}: no prompts")
    return prompts, facts, labels, held_out


def _one_line(text: object, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_tool_cases(src: Path) -> list[dict]:
    """``SRC/facts.json``'s ``tool_calls`` (``[]`` when there is no file or no such key): each
    ``{"question": str, "tools": [OpenAI function tools], "name": str, "arguments": {..}}``, a
    question asked with ``tools`` declared that the model answers by calling ``name`` with
    exactly ``arguments`` (the embedded model ships five; ``g4.convert.embedded_model`` writes them).

    Raises:
        CheckpointError: ``facts.json`` unreadable or malformed (:func:`g4.convert.verify.read_source_facts`), or
            an entry not of that shape (named by index): a tool that is not an OpenAI function tool
            (:func:`g4.serve.chat.openai_tools`), or a ``name`` none of its tools has.
    """
    read = read_source_facts(src)
    if read is None:
        return []
    path, cases = Path(src) / SOURCE_FACTS, read[2].get("tool_calls", [])
    if not isinstance(cases, list):
        raise CheckpointError(f"{path}: tool_calls must be a list")
    for i, c in enumerate(cases):
        if not (isinstance(c, dict) and isinstance(c.get("question"), str) and c["question"].strip()
                and isinstance(c.get("tools"), list) and c["tools"] and isinstance(c.get("name"), str)
                and isinstance(c.get("arguments"), dict)):
            raise CheckpointError(f"{path}: tool_calls[{i}] must be an object with a non-empty 'question' string, "
                                  f"a non-empty 'tools' list, a 'name' string and an 'arguments' object")
        try:
            declared = [t["function"]["name"] for t in openai_tools(c["tools"])]
        except ChatError as e:
            raise CheckpointError(f"{path}: tool_calls[{i}].{e}") from None
        if c["name"] not in declared:
            raise CheckpointError(f"{path}: tool_calls[{i}].name {c['name']!r} is not one of its tools "
                                  f"({', '.join(map(repr, declared))})")
    return cases


def check_url(url: str) -> str:
    """The base URL (without ``/v1``) of ``--url``.

    Raises:
        G4Error: an empty URL, or one that is not ``http(s)://host[:port][/path]`` (no scheme,
            another scheme, no host, a port that is not a number in 1-65535, a broken IPv6
            literal).
    """
    from urllib.parse import urlsplit

    if not url.strip():
        raise G4Error("--url is empty; give the server's URL (e.g. http://127.0.0.1:8000) or leave --url out")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise G4Error(f"--url {url!r}: not a valid URL ({e})") from e
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise G4Error(f"--url {url!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
    if port == 0:
        raise G4Error(f"--url {url!r}: port 0 is not a TCP port")
    return url.strip().rstrip("/").removesuffix("/v1")


def out_context(out: Path) -> int:
    """Tokens of context (prompt plus reply) OUT's engine allows, read as
    :class:`g4.serve.engine.Engine` reads it (:func:`g4.serve.engine.max_context`)."""
    try:
        config = json.loads((Path(out) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        config = {}
    return max_context(config)


def prompt_lengths(tokenizer, prompts: list[str], labels: list[str], tools: list[list[dict] | None] | None = None
                   ) -> list[int]:
    """Prompt tokens of each prompt as a one-message user chat, rendered the way the server
    renders it (:func:`g4.serve.chat.render_prompt`, generation prompt included), with
    ``tools[i]`` declared when given.

    Raises:
        G4Error: the chat template rejects a prompt (named by its label).
    """
    lengths = []
    for label, prompt, declared in zip(labels, prompts, tools or [None] * len(prompts)):
        try:
            lengths.append(len(render_prompt(tokenizer, [{"role": "user", "content": prompt}], tools=declared)))
        except ChatError as e:
            raise G4Error(f"{label}: {e}") from e
    return lengths


def check_lengths(labels: list[str], lengths: list[int], budgets: list[tuple[str, int]], context: int,
                  context_from: str) -> None:
    """Refuse the first prompt whose tokens plus its reply budget exceed ``context``, before
    any model runs (a prompt past the context only fails at the server, after the slow
    reference has run on it).

    Args:
        budgets: per prompt, ``(option name, max tokens)`` of the reply requested for it.

    Raises:
        G4Error: naming the prompt's label, its token count and the context.
    """
    for label, n, (option, budget) in zip(labels, lengths, budgets):
        if n + budget > context:
            raise G4Error(f"{label}: the prompt is {n} tokens with OUT's chat template; with {option} {budget} "
                          f"that exceeds {context_from} of {context} tokens")


def served_files_difference(loaded: object, now: dict[str, dict[str, int]]) -> str | None:
    """The first difference between a server's ``/v1/models`` ``g4_served_files`` (the stats
    of the files its engine loaded, :func:`g4.serve.engine.served_file_stats`) and OUT's files
    now, in words; ``None`` when they are the same files, unchanged since."""
    if not isinstance(loaded, dict):
        return f"g4_served_files is {type(loaded).__name__}, not an object"
    for name in sorted(set(loaded) | set(now), key=str):
        a, b = loaded.get(name), now.get(name)
        if a == b:
            continue
        if b is None:
            return f"{name}: loaded, not in OUT now"
        if a is None:
            return f"{name}: in OUT now, not loaded"
        if not isinstance(a, dict) or a.get("bytes") != b["bytes"]:
            size = a.get("bytes") if isinstance(a, dict) else a
            return f"{name}: {size} bytes loaded, {b['bytes']} bytes now"
        return f"{name}: modified since it was loaded (mtime_ns {a.get('mtime_ns')}, now {b['mtime_ns']})"
    return None


@contextlib.contextmanager
def _request(base: str, what: str) -> Iterator[None]:
    """Turn a failed request about ``what`` (e.g. ``"prompt 3 ('Who wrote...')"``) into a
    one-line :class:`G4Error`: the server refused it (HTTP 400), answered another error
    status (e.g. 500), or the connection was lost (the server died, or the URL is wrong)."""
    import openai

    try:
        yield
    except openai.BadRequestError as e:
        raise G4Error(f"{what}: the server refused it: {_server_message(e)}") from e
    except openai.APIStatusError as e:
        raise G4Error(f"{what}: {base} answered HTTP {e.status_code} ({_server_message(e)}); "
                      f"see the server's log") from e
    except openai.APIConnectionError as e:
        raise _connection_lost(base, what, e) from e


def _server_message(e: Exception) -> str:
    """The server's own ``error.message`` of an HTTP error, else the client's text, on one line."""
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return _one_line(body["message"])
    return _one_line(getattr(e, "message", e))


def _connection_lost(base: str, what: str, e: Exception) -> G4Error:
    cause = f"{type(e.__cause__).__name__}: {_one_line(e.__cause__, 120)}" if e.__cause__ else _one_line(e)
    return G4Error(f"{what}: lost the connection to {base} ({cause}); is the server still running?")


@dataclass
class _Reference:
    ids: list[list[int]]
    replies: list[str]


def reference_replies(src: Path, prompts: list[str], max_tokens: int) -> tuple[_Reference, object, frozenset[int]]:
    """Greedy replies of SRC to ``prompts``: transformers' Gemma 4 layers in bf16, streamed one
    decoder layer at a time with a KV cache per prompt (:func:`g4.convert.stream.streamed_greedy`,
    the same source ``g4convert verify`` runs), so the 26B's reference fits about one layer of RAM.

    Returns:
        (ids and parsed content per prompt, SRC tokenizer, SRC stop ids).

    Raises:
        G4Error: a SRC weight file changed (rewritten, replaced, relinked) while it was read
            (:class:`g4.core.checkpoint.FileRecords`): the replies would mix two SRCs.
    """
    tokenizer = load_tokenizer(src)
    stop_ids = Engine(src, tokenizer, "source").stop_ids
    control = ControlIds.from_tokenizer(tokenizer)
    prompt_ids = [render_prompt(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    model = SourceStream(src)
    files = FileRecords.of_checkpoint(model.ckpt)
    with files.reading(src, "g4serve check"):
        generated = streamed_greedy(model, prompt_ids, max_new_tokens=max_tokens, eos_token_ids=sorted(stop_ids))
    files.check_unchanged(src, "g4serve check")
    ids, replies = [], []
    for p_ids, gen in zip(prompt_ids, generated):  # each ends at its first stop id, if it reached one
        parser = ReplyParser(tokenizer, control, p_ids)
        d = parser.feed(gen)
        d += parser.finish()
        ids.append(gen)
        replies.append(d.content)
    return _Reference(ids, replies), tokenizer, stop_ids


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(out: Path, fmt: ResultFormat, backend: str, *, served_model_name: str,
                   act_quant: bool | None = None, dtype: str = "bfloat16",
                   vllm_timeout_s: float = 900.0, progress: bool = False) -> Iterator[str]:
    """Serve ``out`` on a free loopback port for the duration of the block; yields the base URL
    (``http://127.0.0.1:PORT``, without ``/v1``). ``progress``: the CPU engine's load bar.

    Raises:
        G4Error: the backend cannot start (e.g. vLLM exits early or is not ready in time).
    """
    if backend == "vllm":
        with VllmServer(out.resolve(), host="127.0.0.1", port=free_port(), served_model_name=served_model_name) as vs:
            vs.wait_ready(vllm_timeout_s)
            yield vs.url.removesuffix("/v1")
        return

    if backend == "neuron":
        engine = load_neuron_engine(out)
    else:
        engine = load_cpu_engine(out, act_quant=act_quant, dtype=dtype, fmt=fmt, progress=progress)
    app = create_app(engine, served_model_name=served_model_name)
    with BackgroundServer(app) as srv:
        yield srv.url


def _ask(client, model: str, question: str, max_tokens: int, *, stream: bool = False,
         template_kwargs: dict | None = None) -> tuple[str, str, list[int] | None, str | None]:
    """One greedy chat request: ``(content, reasoning, token_ids or None, finish_reason)``."""
    extra: dict = {"return_token_ids": True}
    if template_kwargs is not None:
        extra["chat_template_kwargs"] = template_kwargs
    kw = dict(model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=max_tokens,
              extra_body=extra)
    if not stream:
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        msg_extra = choice.message.model_extra or {}
        reasoning = msg_extra.get("reasoning_content") or msg_extra.get("reasoning") or ""
        ids = (choice.model_extra or {}).get("token_ids")
        return choice.message.content or "", reasoning, ids, choice.finish_reason
    content, reasoning, finish = [], [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            d_extra = choice.delta.model_extra or {}
            content.append(choice.delta.content or "")
            reasoning.append(d_extra.get("reasoning_content") or d_extra.get("reasoning") or "")
            finish = choice.finish_reason or finish
    return "".join(content), "".join(reasoning), None, finish


def tool_call_checks(client, model: str, base: str, cases: list[dict], max_tokens: int, echo) -> list[dict]:
    """Each :func:`load_tool_cases` question asked greedily with its tools declared (``tool_choice``
    ``auto``, non-streamed); right when the reply is exactly one call, ``finish_reason``
    ``"tool_calls"``, of the expected function with arguments equal (as JSON) to the expected.

    Returns:
        ``[{"question", "expected": {"name", "arguments"}, "calls": [{"name", "arguments"}],
        "content", "finish_reason", "ok"}]``; ``arguments`` of a call is the parsed JSON object,
        or its text when it is not JSON.

    Raises:
        G4Error: the connection was lost or the server answered an error status (named).
    """
    rows = []
    for case in cases:
        question = case["question"]
        with _request(base, f"tool question {question[:40]!r}"):
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                               tools=case["tools"], temperature=0, max_tokens=max_tokens)
        choice = r.choices[0]
        calls = []
        for call in choice.message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
            except (TypeError, ValueError):
                arguments = call.function.arguments
            calls.append({"name": call.function.name, "arguments": arguments})
        expected = {"name": case["name"], "arguments": case["arguments"]}
        ok = choice.finish_reason == "tool_calls" and calls == [expected]
        rows.append({"question": question, "expected": expected, "calls": calls,
                     "content": choice.message.content or "", "finish_reason": choice.finish_reason, "ok": ok})
        got = describe_calls(calls) or repr(choice.message.content)
        echo(f"  {'ok ' if ok else 'BAD'} tool {question!r} -> {got} (expected {describe_calls([expected])})")
    return rows


def chat_checks(client, model: str, max_tokens: int, base: str = "the server") -> list[dict]:
    """The P13 four-way check: thinking off/on x non-stream/stream, each reported.

    Raises:
        G4Error: the connection to ``base`` was lost (no verdict is possible then; an HTTP
            error status is that combination's failure instead).
    """
    import openai

    results = []
    for thinking in (False, True):
        first = None
        for stream in (False, True):
            try:
                content, reasoning, _, finish = _ask(client, model, P13_QUESTION, max_tokens, stream=stream,
                                                     template_kwargs={"enable_thinking": thinking})
            except openai.APIConnectionError as e:
                what = f"chat check (thinking {'on' if thinking else 'off'}, {'stream' if stream else 'non-stream'})"
                raise _connection_lost(base, what, e) from e
            except Exception as e:  # an HTTP or protocol error is this combination's failure
                results.append({"thinking": thinking, "stream": stream, "ok": False, "content": "",
                                "problem": f"request failed: {type(e).__name__}: {e}"})
                continue
            problems = []
            if not content.strip():
                problems.append(f"empty content (finish_reason {finish}"
                                + (", reasoning only" if reasoning else "") + ")")
            leaked = control_text_in(content)
            if leaked:
                problems.append(f"content carries {', '.join(leaked)}")
            leaked = control_text_in(reasoning)
            if leaked:
                problems.append(f"reasoning carries {', '.join(leaked)}")
            if content.strip() and P13_ANSWER not in content:
                problems.append(f"content {content!r} lacks the answer {P13_ANSWER!r}")
            if first is None:
                first = content
            elif content != first:
                problems.append(f"streamed content {content!r} differs from non-streamed {first!r}")
            results.append({"thinking": thinking, "stream": stream, "ok": not problems, "content": content,
                            "problem": "; ".join(problems) or None})
    return results


def write_report(out: Path, report: dict) -> Path:
    """Write ``out/verification.json`` atomically (:func:`g4.exporters.output_dir.write_text_atomic`)."""
    return write_text_atomic(Path(out) / VERIFICATION_FILE, json.dumps(report, indent=2, ensure_ascii=False) + "\n",
                             placed=True)


def run_check(out: str | Path, src: str | Path, *, source_label: str | None = None, prompts_file: Path | None = None,
              min_agreement: float = 0.9, url: str | None = None, max_tokens: int = 16,
              chat_max_tokens: int = 256, backend: str = "auto", act_quant: bool | None = None,
              dtype: str = "bfloat16", served_model_name: str | None = None,
              echo: Callable[[str], None] = print, progress: bool = False) -> dict:
    """Check the result ``out`` against its source ``src`` through an OpenAI-compatible server
    (started here on a free loopback port, or the one at ``url``) and write
    ``out/verification.json``.

    Args:
        max_tokens: generation budget per prompt and fact (tokens).
        chat_max_tokens: budget of each P13 chat request (thinking needs room).
        backend: as ``g4serve --backend`` (ignored with ``url``; the report then names the
            backend from ``/v1/models`` ``owned_by``).
        progress: a bar on stderr while the CPU engine loads a whole model.

    Returns:
        The report (see the module docstring); ``report["passed"]`` says whether it passed.

    Raises:
        G4Error: unreadable OUT/SRC or prompts, an OUT that differs from its format's table
            (:func:`g4.exporters.formats.check_result`: nothing is served or written), a SRC g4convert would refuse (already quantized, a
            tensor not BF16/F16/F32, a shard named outside it), an empty or malformed ``url``, a prompt longer
            than OUT's context (checked before any model loads), a backend that cannot start,
            an unreachable ``url`` or one serving anything but OUT as it is now (another
            directory, a relative root, weight files changed since it loaded them), or a
            request that fails mid-check (connection lost, an HTTP error status). Only a
            completed check returns; a FAIL is ``report["passed"] == False``.
    """
    out, src = Path(out), Path(src)
    fmt = check_result(out)  # against its format's table, before anything is served or written
    _check_pair(out, src)
    base_url = check_url(url) if url is not None else None
    prompts, held_out, facts, tool_cases, lengths = _load_and_measure_prompts(out, src, prompts_file, max_tokens,
                                                                              chat_max_tokens)
    files = weight_fingerprints(out)
    if base_url is not None:
        chosen, why = None, f"external server {url}"
        ctx = contextlib.nullcontext(base_url)
    else:
        chosen, why = choose_backend(fmt, backend)
        ctx = running_server(out, fmt, chosen, served_model_name=served_model_name or out.resolve().name,
                             act_quant=act_quant, dtype=dtype, progress=progress)
    echo(f"backend {chosen or 'external'}: {why}")
    with ctx as base:
        client, model, listed_extra, owned = _served_model(base, out, url, served_model_name, lengths)
        engine_desc = listed_extra.get("g4_engine")  # g4's own server says what arithmetic it runs
        if chosen is None:
            chosen = {"vllm": "vllm", "g4-cpu": "cpu", "g4-neuron": "neuron"}.get(owned, owned or "unknown")
        n_held_out = sum(h is True for h in held_out)
        echo(f"reference: {source_label or src} in transformers, greedy, {len(prompts)} prompts"
             + (f" ({n_held_out} held-out)" if n_held_out else ""))
        rows, served, agreed, from_server = _compare_prompts(client, model, base, src, prompts, held_out,
                                                             max_tokens, echo)
        fact_rows = _ask_facts(client, model, base, facts, served, max_tokens, echo)
        tool_rows = tool_call_checks(client, model, base, tool_cases, chat_max_tokens, echo)
        checks = chat_checks(client, model, chat_max_tokens, base)
        for c in checks:
            echo(f"  chat thinking={'on ' if c['thinking'] else 'off'} stream={'yes' if c['stream'] else 'no '}: "
                 f"{'ok' if c['ok'] else 'FAIL: ' + c['problem']} content={c['content']!r}")

    matches, positions, exact = agreed
    overall_agreement = matches / positions if positions else 1.0
    failures = _failures(overall_agreement, min_agreement, fact_rows, checks, tool_rows)
    report = {
        "g4_verification": 1, "format": fmt.format, "backend": chosen, "engine": engine_desc,
        "source": pushable_source_label(src, read_json_object(src / CONFIG_NAME)),  # never a local path: it can be pushed
        "min_agreement": min_agreement, "passed": not failures, "failures": failures,
        "overall": {"prompts": len(prompts), "token_agreement": round(overall_agreement, 6),
                    "exact_match_prompts": exact,
                    "facts_correct": sum(f["ok"] for f in fact_rows) if facts else None,
                    "facts_total": len(facts) if facts else None,
                    "tool_calls_correct": sum(t["ok"] for t in tool_rows) if tool_rows else None,
                    "tool_calls_total": len(tool_rows) if tool_rows else None,
                    "token_ids_from": "server" if from_server else "retokenized", "max_tokens": max_tokens},
        "prompts": rows, "facts": fact_rows, "tool_calls": tool_rows, "chat_checks": checks, "files": files,
    }
    path = write_report(out, report)
    rerender_card(out)
    facts_line = f", facts {report['overall']['facts_correct']}/{len(facts)}" if facts else ""
    facts_line += f", tool calls {report['overall']['tool_calls_correct']}/{len(tool_rows)}" if tool_rows else ""
    echo(f"token agreement {overall_agreement:.3f} over {positions} positions of {len(prompts)} prompts "
         f"({exact} identical){facts_line}; chat checks {sum(c['ok'] for c in checks)}/{len(checks)}; "
         f"report {path}")
    return report


def _check_pair(out: Path, src: Path) -> None:
    """Refuse a g4 result or an unconvertible checkpoint as SRC, one OUT was not converted from,
    and an unwritable OUT."""
    try:  # a g4 result passed as the source: say so
        src_fmt = detect_format(src)
    except CheckpointError:  # anything else wrong with SRC: the converters' own refusal, below
        src_fmt = None
    if src_fmt is not None and src_fmt.format != "bf16":
        raise G4Error(f"--against {src}: that is {a_or_an(src_fmt.detail)} result, not the source checkpoint "
                      "it came from")
    Checkpoint(src, source=True)  # shard names, quantized sources and dtypes refused as g4convert refuses them
    check_converted_from(out, src)  # the rule verify applies too
    if not os.access(out, os.W_OK):
        raise G4Error(f"{out}: not writable; check writes {VERIFICATION_FILE} there")


def _load_and_measure_prompts(out: Path, src: Path, prompts_file: Path | None, max_tokens: int,
                              chat_max_tokens: int):
    """The prompts, facts and tool questions, every request checked against OUT's context before
    a model loads. Returns ``(prompts, held_out, facts, tool_cases, lengths)``, ``lengths =
    (labels, token counts, budgets)`` for the server's own context check (tool questions
    measured with their declarations)."""
    prompts, facts, labels, held_out = load_prompts(prompts_file, src)
    tool_cases = load_tool_cases(src)
    # every request's length against OUT's context before the reference or the server runs
    # (a 600k-token line would otherwise go through transformers first)
    extra_facts = [(q, a) for q, a in facts if q not in prompts]
    texts = prompts + [q for q, _ in extra_facts] + [P13_QUESTION]
    text_labels = ([f"prompt {i} ({label})" for i, label in enumerate(labels, 1)]
                   + [f"fact question {q[:40]!r}" for q, _ in extra_facts] + ["the P13 chat question"])
    budgets = [("--max-tokens", max_tokens)] * (len(texts) - 1) + [("--chat-max-tokens", chat_max_tokens)]
    tool_labels = [f"tool question {c['question'][:40]!r}" for c in tool_cases]
    tokenizer = load_tokenizer(out)
    lengths = (prompt_lengths(tokenizer, texts, text_labels)
               + prompt_lengths(tokenizer, [c["question"] for c in tool_cases], tool_labels,
                                [c["tools"] for c in tool_cases]))
    text_labels += tool_labels
    budgets += [("--chat-max-tokens", chat_max_tokens)] * len(tool_cases)
    check_lengths(text_labels, lengths, budgets, out_context(out), f"{out}'s context")
    return prompts, held_out, facts, tool_cases, (text_labels, lengths, budgets)


def _served_model(base: str, out: Path, url: str | None, served_model_name: str | None, lengths):
    """Connect to the server at ``base`` and check that it serves OUT as it is now (for an
    external ``url``) within its context. Returns ``(client, model id, model_extra, owned_by)``."""
    import openai

    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                               timeout=600.0, max_retries=0)
        listing = client.models.list().data
    except Exception as e:  # openai errors, and the HTTP library's for a URL it cannot use
        raise G4Error(f"{base}: no OpenAI-compatible server answers ({type(e).__name__}: {_one_line(e)})") from e
    ids_listed = [m.id for m in listing]
    if not ids_listed or (served_model_name and served_model_name not in ids_listed):
        raise G4Error(f"{base} serves {ids_listed}, not {served_model_name!r}")
    model = served_model_name or ids_listed[0]
    listed = next(m for m in listing if m.id == model)
    listed_extra = listed.model_extra or {}
    if url is not None:  # an external server must serve OUT as it is now, or its PASS is about other weights
        root = listed_extra.get("root") or getattr(listed, "root", None)
        if root and not Path(str(root)).is_absolute():  # relative to the server's cwd, which we cannot know
            raise G4Error(f"{base} reports root {str(root)!r}, a relative path that cannot be compared with "
                          f"OUT; start it with an absolute path (g4serve {out.resolve()})")
        if not root or Path(str(root)).resolve() != out.resolve():
            raise G4Error(f"{base} serves {root or model!r}, not {out}; start it on OUT "
                          f"(g4serve {out}) or leave out --url")
        if "g4_served_files" in listed_extra:  # g4's own server: the files its engine loaded
            diff = served_files_difference(listed_extra["g4_served_files"], served_file_stats(out))
            if diff:
                raise G4Error(f"{base} loaded other files than {out} has now ({diff}); "
                              f"restart the server on OUT")
    served_context = listed_extra.get("max_model_len")
    if isinstance(served_context, int) and not isinstance(served_context, bool):
        text_labels, token_counts, budgets = lengths
        check_lengths(text_labels, token_counts, budgets, served_context, f"{base}'s max_model_len")
    owned = listed_extra.get("owned_by") or getattr(listing[0], "owned_by", "")
    return client, model, listed_extra, owned


def _compare_prompts(client, model: str, base: str, src: Path, prompts: list[str], held_out: list[bool | None],
                     max_tokens: int, echo):
    """The prompts through the server and through SRC in transformers, compared token by token.
    Returns ``(rows, served replies, (matches, positions, identical prompts), ids came from the server)``."""
    ref, src_tokenizer, src_stop_ids = reference_replies(src, prompts, max_tokens)
    rows, matches, positions, exact, from_server = [], 0, 0, 0, True
    served_all = []
    for i, prompt in enumerate(prompts, 1):
        with _request(base, f"prompt {i} ({prompt[:40]!r})"):
            content, _, ids, finish = _ask(client, model, prompt, max_tokens)
        served_all.append((content, ids, finish))
        from_server &= ids is not None
    for prompt, held, (content, ids, finish), ref_ids, ref_reply in zip(prompts, held_out, served_all, ref.ids,
                                                                       ref.replies):
        if from_server:
            a = normalise_ids(ids, src_stop_ids, finish == "stop")
            b = normalise_ids(ref_ids, src_stop_ids, False)
        else:  # compare text through the source tokenizer on both sides
            a = src_tokenizer.encode(content, add_special_tokens=False) + ([STOP] if finish == "stop" else [])
            b = (src_tokenizer.encode(ref_reply, add_special_tokens=False)
                 + ([STOP] if ref_ids and ref_ids[-1] in src_stop_ids else []))
        frac, first, m, n = agreement(a, b)
        matches, positions, exact = matches + m, positions + n, exact + (first is None)
        rows.append({"prompt": prompt, "held_out": held, "token_agreement": round(frac, 6), "first_divergence": first,
                     "reply": content, "reference_reply": ref_reply})
        echo(f"  {frac:6.3f} {'=' if first is None else f'@{first}':>4} {'held-out' if held else '':8} "
             f"{prompt!r} -> {content!r} "
             f"(reference {ref_reply!r})")
    return rows, {p: c for p, (c, _, _) in zip(prompts, served_all)}, (matches, positions, exact), from_server


def _ask_facts(client, model: str, base: str, facts, replies: dict[str, str], max_tokens: int, echo) -> list[dict]:
    """Each fact answered by the server (a prompt's reply reused when the question was one)."""
    fact_rows = []
    for question, answer in facts:
        if question in replies:
            content = replies[question]
        else:
            with _request(base, f"fact question {question[:40]!r}"):
                content = _ask(client, model, question, max_tokens)[0]
        ok = content.strip().startswith(answer)
        fact_rows.append({"question": question, "answer": answer, "reply": content, "ok": ok})
        echo(f"  {'ok ' if ok else 'BAD'} {question!r} -> {content!r} (expected {answer!r})")
    return fact_rows


def _failures(overall_agreement: float, min_agreement: float, fact_rows: list[dict], checks: list[dict],
              tool_rows: list[dict] = ()) -> list[str]:
    failures = []
    if overall_agreement < min_agreement:
        failures.append(f"token agreement {overall_agreement:.3f} < {min_agreement}")
    bad_facts = [f["question"] for f in fact_rows if not f["ok"]]
    if bad_facts:
        failures.append(f"{len(bad_facts)} fact(s) answered wrong")
    bad_tools = [t["question"] for t in tool_rows if not t["ok"]]
    if bad_tools:
        failures.append(f"{len(bad_tools)} tool call(s) wrong")
    bad_checks = [f"thinking {'on' if c['thinking'] else 'off'}/{'stream' if c['stream'] else 'non-stream'}"
                  for c in checks if not c["ok"]]
    if bad_checks:
        failures.append(f"chat check failed: {', '.join(bad_checks)}")
    return failures
