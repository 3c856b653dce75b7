"""Chat prompt rendering and reply parsing for Gemma 4 (reasoning channel, control tokens, stop strings).

Gemma 4 replies are token sequences such as::

    <|channel>thought\\n ...reasoning... <channel|> answer <turn|>

(format: the ``chat_template.jinja`` of google/gemma-4-26B-A4B-it and huggingface/transformers
``src/transformers/cli/serving/utils.py``; the failure modes: case P13, vllm-project/vllm
issues #39885, #49717). The parser here works on token **ids**, never on
decoded text, so it cannot be fooled by special tokens that were already stripped (the
non-streaming bug of vLLM PR #38858) or by text that merely looks like a control token:

* ``<|channel>`` opens a channel; the text up to the first ``\\n`` is its name (``thought``)
  and is dropped; everything until ``<channel|>`` goes to ``reasoning_content``.
* Every other special token (``<turn|>``, ``<|think|>``, ``<|turn>``, ``<eos>``, tool tokens)
  is dropped from both fields: ``content`` never carries control-token text.
* A prompt that ends inside an open channel (a template that opens the thought block for the
  model) starts the parser in the reasoning state; one that ends with an empty closed block
  (``<|channel>thought\\n<channel|>``, the 26B template with thinking off) starts in content.

The parser is incremental (:meth:`ReplyParser.feed` one or more ids at a time); the
non-streaming reply is the concatenation of the same deltas, so streamed and non-streamed
text are identical by construction (tested token by token and over HTTP).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field

from g4.core.errors import a_or_an
from g4.core.prompt import ChatError, chat_ids, text_ids

# Control tokens by their text; ids come from the tokenizer (real Gemma 4: 100, 101, 106, 98).
CHANNEL_OPEN, CHANNEL_CLOSE, TURN_END, THINK, TURN_OPEN = "<|channel>", "<channel|>", "<turn|>", "<|think|>", "<|turn>"
CONTROL_TEXTS = (CHANNEL_OPEN, CHANNEL_CLOSE, TURN_END, THINK)
# Tool-call markup (real Gemma 4: ids 46-52; spec table of control tokens).
TOOL_OPEN, TOOL_CLOSE, CALL_OPEN, CALL_CLOSE = "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>"
RESPONSE_OPEN, RESPONSE_CLOSE, STRING_DELIM = "<|tool_response>", "<tool_response|>", '<|"|>'
# apply_chat_template arguments a request may not override through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "return_dict", "return_tensors", "continue_final_message", "chat_template",
                                      "tools", "documents", "padding", "truncation", "max_length",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class ControlIds:
    """Ids of the Gemma 4 control tokens in one tokenizer (``None`` where it has no such token).

    ``special``: every id the tokenizer marks special (added tokens with ``special=True`` and
    ``all_special_ids``); none of them is ever decoded into ``content`` or ``reasoning_content``.
    """

    channel_open: int | None
    channel_close: int | None
    turn_end: int | None
    think: int | None
    turn_open: int | None
    special: frozenset[int]
    call_open: int | None = None
    call_close: int | None = None
    string_delim: int | None = None
    markup: frozenset[int] = frozenset()  # tool markup ids that read as text outside a call

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ControlIds":
        def lookup(text: str) -> int | None:
            i = tokenizer.convert_tokens_to_ids(text)
            return i if isinstance(i, int) and i != tokenizer.unk_token_id else None

        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        special |= set(tokenizer.all_special_ids)
        ids = {name: lookup(text) for name, text in
               (("channel_open", CHANNEL_OPEN), ("channel_close", CHANNEL_CLOSE), ("turn_end", TURN_END),
                ("think", THINK), ("turn_open", TURN_OPEN))}
        special |= {i for i in ids.values() if i is not None}
        tool = {name: lookup(text) for name, text in
                (("call_open", CALL_OPEN), ("call_close", CALL_CLOSE), ("string_delim", STRING_DELIM))}
        # <|tool_response> is a stop id (the model ends a calling turn with it): never text.
        markup = {lookup(t) for t in (TOOL_OPEN, TOOL_CLOSE, CALL_OPEN, CALL_CLOSE, RESPONSE_CLOSE, STRING_DELIM)}
        markup.discard(None)
        return cls(special=frozenset(special | markup), markup=frozenset(markup), **ids, **tool)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``index`` (its place among the reply's calls, from 0), ``id``
    (``call_`` + 24 hex digits), ``name`` and ``arguments`` (a JSON object, as text)."""

    index: int
    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        """The call as OpenAI's ``tool_calls[i]`` (streamed, plus ``index``)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """New output of one step: ``reasoning`` (thought channel), ``content`` (the answer) and
    complete ``tool_calls``."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __iadd__(self, other: "Delta") -> "Delta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class MalformedCall(ValueError):
    """Tool-call markup that is not ``call:NAME{...}`` in Gemma 4's argument syntax."""


_DELIM = object()  # the <|"|> token in a call's items (it is one id, never the text that spells it)
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:\-]*")
_BARE_END = ",}]"


def parse_call_items(items: list) -> tuple[str, dict]:
    """``(name, arguments)`` of a call's body: ``items`` are the characters of
    ``call:NAME{key:value,...}`` with the ``<|"|>`` token as one :data:`_DELIM` item.

    Gemma 4's syntax (the release chat template's ``format_argument``; parsers: vllm-project/vllm
    ``vllm/parser/gemma4.py``, huggingface/transformers ``src/transformers/cli/serving/utils.py``):
    a string is ``<|"|>text<|"|>`` (any text, ``{},:`` included), keys are bare (or delimited),
    numbers are JSON numbers and stay numbers (vLLM's parser returns them as strings),
    ``true``/``false``/``null``, objects ``{k:v,...}``, arrays ``[v,...]``. Whitespace between
    items is allowed. Function names may hold ``. : -`` (namespaced MCP tools, jundot/omlx PR #1854).

    Raises:
        MalformedCall: anything else (an unterminated string or object, a bare word, trailing text,
            a key twice in one object, a number beyond a 64-bit float such as ``1e400``).
    """
    n, i = len(items), 0

    def ws(i):
        while i < n and items[i] is not _DELIM and items[i].isspace():
            i += 1
        return i

    def value(i):
        i = ws(i)
        if i >= n:
            raise MalformedCall("a value is missing")
        c = items[i]
        if c is _DELIM:
            j = i + 1
            while j < n and items[j] is not _DELIM:
                j += 1
            if j >= n:
                raise MalformedCall("an unterminated string")
            return "".join(items[i + 1:j]), j + 1
        if c == "{":
            return obj(i + 1)
        if c == "[":
            out, i = [], ws(i + 1)
            if i < n and items[i] == "]":
                return out, i + 1
            while True:
                v, i = value(i)
                out.append(v)
                i = ws(i)
                if i < n and items[i] == ",":
                    i += 1
                elif i < n and items[i] == "]":
                    return out, i + 1
                else:
                    raise MalformedCall("an unterminated array")
        j = i
        while j < n and items[j] is not _DELIM and items[j] not in _BARE_END:
            j += 1
        word = "".join(items[i:j]).strip()
        if word in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[word], j
        if _NUMBER.fullmatch(word):
            number = json.loads(word)
            if isinstance(number, float) and not math.isfinite(number):  # 1e400: json.dumps would write Infinity, not JSON
                raise MalformedCall(f"{word[:40]!r} does not fit a 64-bit float")
            return number, j
        raise MalformedCall(f"{word[:40]!r} is not a string, number, boolean or null")

    def obj(i):
        out, i = {}, ws(i)
        if i < n and items[i] == "}":
            return out, i + 1
        while True:
            i = ws(i)
            if i < n and items[i] is _DELIM:
                key, i = value(i)
            else:
                j = i
                while j < n and items[j] is not _DELIM and items[j] not in ":{}[],":
                    j += 1
                key, i = "".join(items[i:j]).strip(), j
                if not key:
                    raise MalformedCall("a key is missing")
            i = ws(i)
            if i >= n or items[i] != ":":
                raise MalformedCall(f"no ':' after the key {key!r}")
            if key in out:  # a JSON parser would keep one of them silently
                raise MalformedCall(f"the key {key!r} twice")
            out[key], i = value(i + 1)
            i = ws(i)
            if i < n and items[i] == ",":
                i += 1
            elif i < n and items[i] == "}":
                return out, i + 1
            else:
                raise MalformedCall("an unterminated object")

    head = []
    while i < n and items[i] is not _DELIM and items[i] != "{":
        head.append(items[i])
        i += 1
    head = "".join(head).strip()
    if not head.startswith("call:") or not _NAME.fullmatch(head[5:]) or i >= n:
        raise MalformedCall(f"{head[:60]!r} is not call:NAME{{")
    args, i = obj(i + 1)
    if ws(i) != n:
        raise MalformedCall("text after the arguments")
    return head[5:], args


class _Segment:
    """Ids of one run of ordinary tokens and how much of its decoded text was already emitted."""

    def __init__(self, target: str, skip: int = 0, ids: list[int] | None = None):
        self.target, self.emitted, self.ids = target, skip, ids or []

    def take(self, tokenizer, final: bool) -> str:
        if not self.ids:
            return ""
        text = tokenizer.decode(self.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not final and text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        new, self.emitted = text[self.emitted:], max(self.emitted, len(text))
        return new


class ReplyParser:
    """Incremental split of generated token ids into ``reasoning_content``, ``content`` and
    ``tool_calls``.

    Tool calls: a ``<|tool_call>`` id in the content opens a block that ends at ``<tool_call|>``;
    with ``tools`` its ``call:NAME{...}`` (:func:`parse_call_items`, strings delimited by the
    ``<|"|>`` id) becomes a :class:`ToolCall`, delivered whole when the block closes. A block
    that does not parse, is cut by another control token or by the end of the reply, or any
    block when ``tools`` is False, is content, delimiters' text included (never dropped: the
    markup-stripping bug of vllm-project/vllm #53642, cubist38/mlx-openai-server PR #205).
    Inside the reasoning channel tool markup is reasoning text: a call there is not a call.
    Stray tool markup ids in the content (``<|"|>``, ``<tool_call|>`` ...) are text as well;
    ``<|tool_response>`` is a stop id and dropped like ``<turn|>``.

    Args:
        tokenizer: the checkpoint's tokenizer (used for ``decode`` of ordinary tokens).
        control: its :class:`ControlIds` (``ControlIds.from_tokenizer(tokenizer)``).
        prompt_ids: the rendered prompt; if its last turn (the model's, from the last ``<|turn>``)
            ends inside an open channel or an open ``<|tool_call>`` block (a forced call's
            prefill, :func:`tool_prefill_ids`), the reply starts inside it. Earlier turns do not
            count: a user who types ``<|channel>`` does not move the answer into
            ``reasoning_content``.
        channels: False for plain text (text completions, no chat template): channel and tool
            tokens are dropped like every other control token and all text is ``content``.
        tools: parse tool-call blocks into :class:`ToolCall` (the request declared tools and its
            ``tool_choice`` is not ``none``).
    """

    def __init__(self, tokenizer, control: ControlIds, prompt_ids: list[int] | None = None, *,
                 channels: bool = True, tools: bool = False):
        self.tokenizer, self.control, self.channels, self.tools = tokenizer, control, channels, tools
        self.state, self.segment = "content", _Segment("content")
        self.call: list[int] | None = None  # ids of an open tool-call block (in the content)
        self.calls = 0
        if channels and prompt_ids:
            starts = [i for i, t in enumerate(prompt_ids) if t == control.turn_open]
            tail = list(prompt_ids[starts[-1]:] if starts else prompt_ids)
            start = None
            for open_id, close_id in ((control.channel_open, control.channel_close),
                                      (control.call_open, control.call_close)):
                opens = [i for i, t in enumerate(tail) if open_id is not None and t == open_id]
                closes = [i for i, t in enumerate(tail) if t == close_id]
                if opens and (not closes or closes[-1] < opens[-1]):
                    start = opens[-1] if start is None else min(start, opens[-1])
            if start is not None:
                # The template (or a forced call) opened a block for the model: replay its tail
                # so that the reply continues in it; the prompt's own text is not part of the reply.
                self.feed(tail[start:])

    def feed(self, ids) -> Delta:
        """Parse generated ``ids`` (an int or a list of ints); return the output they complete."""
        out = Delta()
        for t in [ids] if isinstance(ids, int) else ids:
            out += self._one(int(t))
        return out

    def finish(self) -> Delta:
        """Flush text held back for an incomplete multi-byte character, and an unterminated
        tool-call block as content."""
        if self.call is not None:
            return self._call_as_content()
        return self._flush(final=True)

    def _flush(self, final: bool) -> Delta:
        seg = self.segment
        if seg.target == "header":
            return Delta()
        text = seg.take(self.tokenizer, final)
        return Delta(reasoning=text) if seg.target == "reasoning" else Delta(content=text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _call_as_content(self, closed: bool = False) -> Delta:
        ids, self.call = self.call or [], None
        return Delta(content=CALL_OPEN + self._decode(ids) + (CALL_CLOSE if closed else ""))

    def _close_call(self) -> Delta:
        if not self.tools:
            return self._call_as_content(closed=True)
        items: list = []
        run: list[int] = []
        for t in self.call + [self.control.string_delim]:
            if t == self.control.string_delim:
                items += list(self._decode(run)) if run else []
                items.append(_DELIM)
                run = []
            else:
                run.append(t)
        try:
            name, args = parse_call_items(items[:-1])
        except MalformedCall:
            return self._call_as_content(closed=True)
        self.call = None
        call = ToolCall(self.calls, f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args, ensure_ascii=False))
        self.calls += 1
        return Delta(tool_calls=[call])

    def _one(self, t: int) -> Delta:
        c = self.control
        if self.call is not None:
            if t == c.call_close:
                return self._close_call()
            if t in c.special and t != c.string_delim:  # the block is cut: it was not a call
                out = self._call_as_content()
                out += self._one(t)
                return out
            self.call.append(t)
            return Delta()
        if t in c.markup and self.channels and self.state in ("content", "reasoning"):
            if t == c.call_open and self.state == "content":
                out = self._flush(final=True)
                self.call, self.segment = [], _Segment("content")
                return out
            self.segment.ids.append(t)  # tool markup outside a call block is text
            return self._flush(final=False)
        if t in c.special:
            out = self._flush(final=True)
            if not self.channels:
                self.segment = _Segment("content")
            elif t == c.channel_open:
                self.state, self.segment = "header", _Segment("header")
            elif t == c.channel_close:
                self.state, self.segment = "content", _Segment("content")
            else:  # <turn|>, <|think|>, <eos>, <|tool_response> ...: never text
                self.segment = _Segment(self.segment.target)
            return out
        self.segment.ids.append(t)
        if self.state == "header":
            text = self._decode(self.segment.ids)
            if "\n" not in text:
                return Delta()
            # The channel name ends at the first newline; the rest of this decode is reasoning.
            self.state = "reasoning"
            self.segment = _Segment("reasoning", skip=text.index("\n") + 1, ids=self.segment.ids)
        return self._flush(final=False)


class StopMatcher:
    """Stop strings on the content stream: text up to (not including) the first match is
    released; text that could still be the start of a stop string is held back.

    Args:
        stops: the request's stop strings (empty strings ignored).
    """

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.buffer = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """Add ``text``; return what can be released now. After a match ``hit`` is True and
        further text is discarded."""
        if self.hit or not text:
            return ""
        if not self.stops:
            return text
        self.buffer += text
        cut = min((i for i in (self.buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.buffer = self.buffer[:cut], ""
            return out
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(self.buffer) + 1))
                    if self.buffer.endswith(s[:k])), default=0)
        out, self.buffer = self.buffer[:len(self.buffer) - hold], self.buffer[len(self.buffer) - hold:]
        return out

    def finish(self) -> str:
        """The held-back text when generation ended without a match."""
        out, self.buffer = ("" if self.hit else self.buffer), ""
        return out


def message_text(content) -> str:
    """Text of an OpenAI message ``content`` (a string, or a list of ``{"type": "text"}`` parts).

    Raises:
        ChatError: a non-text part (images and audio are not served) or a malformed part.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatError(f"only text message content is served (got {a_or_an(repr(kind))} part)")
        parts.append(part["text"])
    return "".join(parts)


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` as the template reads them: ``arguments``
    (a JSON text in OpenAI's API) parsed into an object, so that the template writes it in
    Gemma 4's syntax rather than as JSON inside ``call:NAME{...}``."""
    if not isinstance(calls, list):
        raise ChatError(f"{where}.tool_calls must be a list")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"{where}.tool_calls[{k}] needs function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as e:
                raise ChatError(f"{where}.tool_calls[{k}].function.arguments is not JSON: {e}") from None
        if not isinstance(args, dict):
            raise ChatError(f"{where}.tool_calls[{k}].function.arguments must be a JSON object")
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def openai_tools(tools) -> list[dict]:
    """OpenAI function ``tools`` as the template reads them (``{"type": "function", "function":
    {"name", "description", "parameters"}}``).

    Raises:
        ChatError: a tool that is not a function tool with a name (and a schema object).
    """
    out = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatError(f"tools[{k}] must be a function tool")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"tools[{k}].function needs a name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ChatError(f"tools[{k}].function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": {k2: fn[k2] for k2 in ("name", "description", "parameters")
                                                     if fn.get(k2) is not None}})
    return out


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                  tools: list[dict] | None = None) -> list[int]:
    """Prompt ids of a chat, rendered with the checkpoint's own chat template, in which only the
    template's own control tokens are control tokens: message text that spells ``<turn|>``,
    ``<|turn>system`` or ``<bos>`` is tokenized as text (:func:`g4.core.prompt.chat_ids`), and
    the template's ``{{ bos_token }}`` is the only ``<bos>``. ``developer`` messages are passed as
    ``system``. Tool declarations, an assistant's ``tool_calls`` (arguments, a JSON text, parsed
    to an object) and ``role: "tool"`` messages (``tool_call_id`` naming one of the calls of the
    assistant message before them) go to the template, which renders them in Gemma 4's format;
    every string in them (names, descriptions, arguments, results) is text as well.

    Args:
        messages: ``[{"role": str, "content": str | list of text parts | None, "tool_calls": ...,
            "tool_call_id": ...}]``.
        template_kwargs: extra template variables, e.g. ``{"enable_thinking": True}``.
        tools: OpenAI function tools (``None`` or empty: none).

    Returns:
        int token ids.

    Raises:
        ChatError: no chat template, a reserved kwarg, malformed tools, tool calls or tool
            messages, or the template rejects the chat.
    """
    kwargs = dict(template_kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise ChatError(f"chat_template_kwargs may not set {', '.join(bad)}")
    chat, calls = [], {}
    for k, m in enumerate(messages):
        entry = {"role": "system" if m["role"] == "developer" else m["role"], "content": message_text(m.get("content"))}
        if m["role"] == "assistant" and m.get("tool_calls"):
            entry["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{k}]")
            calls = {c["id"]: c["function"]["name"] for c in entry["tool_calls"] if c["id"]}
        elif m["role"] == "tool":
            if not chat or not (chat[-1].get("tool_calls") or chat[-1]["role"] == "tool"):
                raise ChatError(f"messages[{k}]: a tool message must follow an assistant message with tool_calls")
            tid = m.get("tool_call_id")
            if tid not in calls:
                raise ChatError(f"messages[{k}].tool_call_id {tid!r} is not the id of a tool call "
                                "of the assistant message before it")
            entry |= {"tool_call_id": tid, "name": calls[tid]}
        chat.append(entry)
    if tools:
        kwargs["tools"] = openai_tools(tools)
    return chat_ids(tokenizer, chat, kwargs)


def tool_prefill_ids(tokenizer, control: ControlIds, tool_choice) -> list[int]:
    """Ids appended after the generation prompt to force a call (as vLLM and llama.cpp do for
    Gemma 4): ``tool_choice: "required"`` opens the block (``<|tool_call>``), a named function
    also writes its head (``<|tool_call>call:NAME{``, the name as text); ``auto`` / ``none``:
    nothing. The reply parser starts inside that block (:class:`ReplyParser`).

    Raises:
        ChatError: the tokenizer has no ``<|tool_call>`` token.
    """
    if tool_choice in (None, "auto", "none"):
        return []
    if control.call_open is None:
        raise ChatError("this checkpoint's tokenizer has no <|tool_call> token; tool_choice cannot force a call")
    if tool_choice == "required":
        return [control.call_open]
    return [control.call_open] + text_ids(tokenizer, f"call:{tool_choice['function']['name']}{{")


def control_text_in(text: str) -> list[str]:
    """The Gemma 4 control-token texts that occur in ``text`` (P13: content must have none)."""
    return [c for c in CONTROL_TEXTS if c in text]
