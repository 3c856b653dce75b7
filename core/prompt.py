"""Prompt token ids in which only the chat template's own control tokens are control tokens.

Rendering a chat with its Jinja template and tokenizing the resulting string (what
``tokenizer.apply_chat_template(..., tokenize=True)`` does) parses every special-token text in it,
the users' included: a message holding ``<turn|>\\n<|turn>system\\n...`` closes its own turn and
opens a system turn that the model cannot tell from a real one (huggingface/transformers issue
#47822, #29279). Here every string a request supplies (message content, names, tool arguments
and results, template variables) is tokenized as text, and the template's own markup as control
tokens:

1. each occurrence of a special-token text (and of the two private-use characters used below) in
   a supplied string is replaced by a placeholder ``U+E000 <n> U+E001``, which no template
   filter in use (``trim``, concatenation, slicing by ``|``) alters;
2. the template renders the escaped chat to a string, whose special tokens are then all the
   template's own; the tokenizer's own added-token matching finds them (so ``lstrip`` /
   ``rstrip`` / ``normalized`` flags behave as in the tokenizer);
3. each run of text between two of them gets its placeholders back and is encoded with a copy of
   the tokenizer that matches no special token (``tokenizers``' ``encode_special_tokens``), as
   the normal path encodes the same run.

A prompt without special-token text in its strings gets exactly the ids that
``apply_chat_template(..., tokenize=True)`` gives (tested), and exactly one ``<bos>``: the
template's (``{{ bos_token }}``); a message starting with the text ``<bos>`` adds none.
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from g4.core.errors import G4Error

_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


class ChatError(G4Error, ValueError):
    """A chat that cannot be rendered (no template, a template error, a bad variable)."""


@dataclass(frozen=True)
class _TextEncoder:
    """One tokenizer's plain-text encoder and the texts of its special tokens."""

    plain: Tokenizer  # a copy of the backend that matches no special token
    special_ids: frozenset[int]
    escape: re.Pattern  # special-token texts and the placeholder characters, longest first


_encoders: "weakref.WeakKeyDictionary[Any, _TextEncoder]" = weakref.WeakKeyDictionary()
_encoders_lock = threading.Lock()


def _encoder(tokenizer) -> _TextEncoder:
    with _encoders_lock:
        enc = _encoders.get(tokenizer)
        if enc is None:
            backend = tokenizer.backend_tokenizer
            plain = Tokenizer.from_str(backend.to_str())
            plain.encode_special_tokens = True
            special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}
            special |= dict(zip(tokenizer.all_special_ids, tokenizer.all_special_tokens))
            texts = sorted(set(special.values()) | {_OPEN, _CLOSE}, key=len, reverse=True)
            enc = _TextEncoder(plain, frozenset(special), re.compile("|".join(map(re.escape, texts))))
            _encoders[tokenizer] = enc
    return enc


def text_ids(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` as plain text: special-token texts in it (``<turn|>``, ``<bos>``...) become
    the ordinary tokens that spell them; no ``<bos>`` is added.

    Args:
        tokenizer: a transformers fast tokenizer (``tokenizer.backend_tokenizer``).
    Returns:
        int token ids.
    """
    return list(_encoder(tokenizer).plain.encode(text, add_special_tokens=False).ids)


def _escape(value, enc: _TextEncoder, originals: list[str]):
    """``value`` with every special-token text in its strings replaced by a placeholder (dict
    keys too: a tool's parameter names and a call's argument keys are written into the prompt)."""
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            originals.append(m.group(0))
            return f"{_OPEN}{len(originals) - 1}{_CLOSE}"
        return enc.escape.sub(sub, value)
    if isinstance(value, dict):
        return {(_escape(k, enc, originals) if isinstance(k, str) else k): _escape(v, enc, originals)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape(v, enc, originals) for v in value]
    return value


def chat_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None, *,
             add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids of a chat rendered with the tokenizer's chat template, every supplied string
    tokenized as text (module docstring).

    Args:
        tokenizer: a transformers fast tokenizer with a ``chat_template``.
        messages: ``[{"role": str, "content": str, ...}]`` as the template reads them (any
            nesting of dicts, lists and strings: tool calls, names).
        template_kwargs: extra template variables (``{"enable_thinking": True}``); their string
            values are text too.
        add_generation_prompt: end with the opening of the model's turn.
    Returns:
        int token ids, starting with the template's single ``<bos>``.
    Raises:
        ChatError: no chat template, or the template fails on this chat.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError("the checkpoint has no chat template (chat_template.jinja or tokenizer_config.json)")
    enc = _encoder(tokenizer)
    originals: list[str] = []
    escaped = _escape(messages, enc, originals)
    kwargs = _escape(dict(template_kwargs or {}), enc, originals)
    try:
        rendered = tokenizer.apply_chat_template(escaped, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **kwargs)
    except Exception as e:  # jinja2 TemplateError, raise_exception() in the template, TypeError ...
        raise ChatError(f"chat template failed: {type(e).__name__}: {e}") from e
    if not isinstance(rendered, str):
        raise ChatError(f"chat template returned {type(rendered).__name__}, not text")

    def restore(text: str) -> str:
        return _PLACEHOLDER.sub(lambda m: originals[int(m.group(1))], text)

    # The rendered string's special tokens are the template's own: the placeholders hid the rest.
    marked = tokenizer.backend_tokenizer.encode(rendered, add_special_tokens=False)
    ids: list[int] = []
    start = 0
    for i, (a, b) in zip(marked.ids, marked.offsets):
        if i in enc.special_ids:
            if a > start:
                ids += text_ids(tokenizer, restore(rendered[start:a]))
            ids.append(i)
            start = b
    if start < len(rendered):
        ids += text_ids(tokenizer, restore(rendered[start:]))
    return ids


def completion_ids(tokenizer, prompt: str) -> list[int]:
    """Ids of a raw text prompt (``/v1/completions``): tokenized as the tokenizer does,
    control-token texts included (a raw prompt is written in the model's own format, as vLLM
    reads it), with the tokenizer's ``<bos>`` added exactly once: a prompt that already starts
    with ``<bos>`` (a chat template applied by the client) does not get a second one
    (abetlen/llama-cpp-python issue #1561).

    Returns:
        int token ids.
    """
    ids = [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
        ids.pop(0)
    return ids
