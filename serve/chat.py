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

from dataclasses import dataclass

from g4.convert.prompt import ChatError, chat_ids

# Control tokens by their text; ids come from the tokenizer (real Gemma 4: 100, 101, 106, 98).
CHANNEL_OPEN, CHANNEL_CLOSE, TURN_END, THINK, TURN_OPEN = "<|channel>", "<channel|>", "<turn|>", "<|think|>", "<|turn>"
CONTROL_TEXTS = (CHANNEL_OPEN, CHANNEL_CLOSE, TURN_END, THINK)
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
        return cls(special=frozenset(special), **ids)


@dataclass
class Delta:
    """New text of one step: ``reasoning`` (thought channel) and ``content`` (the answer)."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)

    def __iadd__(self, other: "Delta") -> "Delta":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


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
    """Incremental split of generated token ids into ``reasoning_content`` and ``content``.

    Args:
        tokenizer: the checkpoint's tokenizer (used for ``decode`` of ordinary tokens).
        control: its :class:`ControlIds` (``ControlIds.from_tokenizer(tokenizer)``).
        prompt_ids: the rendered prompt; if its last turn (the model's, from the last ``<|turn>``)
            ends inside an open channel the reply starts in the reasoning state. Earlier turns
            do not count: a user who types ``<|channel>`` does not move the answer into
            ``reasoning_content``.
        channels: False for plain text (text completions, no chat template): channel tokens are
            dropped like every other control token and all text is ``content``.
    """

    def __init__(self, tokenizer, control: ControlIds, prompt_ids: list[int] | None = None, *,
                 channels: bool = True):
        self.tokenizer, self.control, self.channels = tokenizer, control, channels
        self.state, self.segment = "content", _Segment("content")
        if channels and prompt_ids and control.channel_open is not None:
            starts = [i for i, t in enumerate(prompt_ids) if t == control.turn_open]
            tail = list(prompt_ids[starts[-1]:] if starts else prompt_ids)
            opens = [i for i, t in enumerate(tail) if t == control.channel_open]
            closes = [i for i, t in enumerate(tail) if t == control.channel_close]
            if opens and (not closes or closes[-1] < opens[-1]):
                # The template opened a channel for the model: replay its tail so that the
                # reply continues in that channel; the prompt's own text is not part of the reply.
                self.feed(tail[opens[-1]:])

    def feed(self, ids) -> Delta:
        """Parse generated ``ids`` (an int or a list of ints); return the text they complete."""
        out = Delta()
        for t in [ids] if isinstance(ids, int) else ids:
            out += self._one(int(t))
        return out

    def finish(self) -> Delta:
        """Flush text held back for an incomplete multi-byte character."""
        return self._flush(final=True)

    def _flush(self, final: bool) -> Delta:
        seg = self.segment
        if seg.target == "header":
            return Delta()
        text = seg.take(self.tokenizer, final)
        return Delta(reasoning=text) if seg.target == "reasoning" else Delta(content=text)

    def _one(self, t: int) -> Delta:
        c = self.control
        if t in c.special:
            out = self._flush(final=True)
            if not self.channels:
                self.segment = _Segment("content")
            elif t == c.channel_open:
                self.state, self.segment = "header", _Segment("header")
            elif t == c.channel_close:
                self.state, self.segment = "content", _Segment("content")
            else:  # <turn|>, <|think|>, <eos>, tool tokens ...: never text
                self.segment = _Segment(self.segment.target)
            return out
        self.segment.ids.append(t)
        if self.state == "header":
            text = self.tokenizer.decode(self.segment.ids, skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
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
            raise ChatError(f"only text message content is served (got a {kind!r} part)")
        parts.append(part["text"])
    return "".join(parts)


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids of a chat, rendered with the checkpoint's own chat template, in which only the
    template's own control tokens are control tokens: message text that spells ``<turn|>``,
    ``<|turn>system`` or ``<bos>`` is tokenized as text (:func:`g4.convert.prompt.chat_ids`), and
    the template's ``{{ bos_token }}`` is the only ``<bos>``. ``developer`` messages are passed as
    ``system``.

    Args:
        messages: ``[{"role": str, "content": str | list of text parts}]``.
        template_kwargs: extra template variables, e.g. ``{"enable_thinking": True}``.

    Returns:
        int token ids.

    Raises:
        ChatError: no chat template, a reserved kwarg, or the template rejects the chat.
    """
    kwargs = dict(template_kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise ChatError(f"chat_template_kwargs may not set {', '.join(bad)}")
    chat = [{"role": "system" if m["role"] == "developer" else m["role"], "content": message_text(m.get("content"))}
            for m in messages]
    return chat_ids(tokenizer, chat, kwargs)


def control_text_in(text: str) -> list[str]:
    """The Gemma 4 control-token texts that occur in ``text`` (P13: content must have none)."""
    return [c for c in CONTROL_TEXTS if c in text]
