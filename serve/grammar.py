"""Structured output: ``response_format`` ``json_object`` / ``json_schema`` through llguidance
(guidance-ai/llguidance, a grammar engine vLLM also uses as a structured-output backend; its Rust
core computes, for the tokens generated so far, which next ids keep the output valid).

The constraint applies to the reply's content, not to its reasoning: with thinking on
(``chat_template_kwargs.enable_thinking``) a reply may open with ``<|channel>`` and reason
freely until ``<channel|>``; when the prompt already leaves the model inside the channel, the
constraint starts after ``<channel|>``; with thinking off the reply is the JSON value. Ids the grammar forbids get ``-inf`` logits before the
sampler draws (so ``logprobs`` are those of the constrained distribution), and once the JSON
value is complete only the stop ids remain. A reply cut by ``max_tokens`` is incomplete JSON with
``finish_reason: "length"``, as OpenAI's.
"""

from __future__ import annotations

import json
import threading
import weakref

import torch

from g4.core.errors import G4Error

# llguidance's JSON layout options ("x-guidance" in a schema; a schema's own wins).
COMPACT_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class GrammarError(G4Error, ValueError):
    """A ``response_format`` that cannot be compiled (not an object, a bad JSON schema)."""


_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _ll_tokenizer(tokenizer, stop_ids: frozenset[int]):
    """llguidance's view of ``tokenizer`` with ``stop_ids`` as its end tokens (built once)."""
    import llguidance.hf

    with _lock:
        by_stops = _tokenizers.setdefault(tokenizer, {})
        if stop_ids not in by_stops:
            by_stops[stop_ids] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer),
                                                              eos_token=sorted(stop_ids))
        return by_stops[stop_ids]


def json_grammar(response_format: dict) -> str | None:
    """The llguidance grammar of an OpenAI ``response_format`` (None for ``text``).

    ``{"type": "json_object"}``: any JSON object; ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}``: a value of that JSON schema. Laid out as ``json.dumps``
    writes it (:data:`COMPACT_JSON`) unless the schema has its own ``x-guidance`` options.

    Raises:
        GrammarError: another type, a missing or non-object schema, or one llguidance rejects.
    """
    from llguidance import LLMatcher

    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None and isinstance(spec, dict):
            schema = {}  # OpenAI: a json_schema without a schema is any JSON value
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema.schema must be a JSON object")
    else:
        raise GrammarError(f"response_format {kind!r} is not supported; only 'text', 'json_object' and 'json_schema'")
    # JSON as json.dumps writes it (", " and ": ", no other whitespace) unless the schema says
    # otherwise: with free whitespace a small model can pad until max_tokens.
    schema = {"x-guidance": dict(COMPACT_JSON)} | schema
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    ok, problem = _validate(grammar)
    if not ok:
        raise GrammarError(f"response_format: the JSON schema cannot be used: {problem}")
    return grammar


def _validate(grammar: str) -> tuple[bool, str]:
    from llguidance import LLMatcher

    try:
        err = LLMatcher.validate_grammar(grammar)
    except Exception as e:  # noqa: BLE001 - a malformed grammar raises from the Rust side
        return False, str(e)
    return (not err), err or ""


class JsonConstraint:
    """The grammar state of one reply.

    Args:
        tokenizer: the checkpoint's fast tokenizer.
        grammar: :func:`json_grammar`'s result.
        stop_ids: ids that may end the reply once the value is complete.
        start_active: False when the reply starts inside the reasoning channel.
        channel_open, channel_close: the ids of ``<|channel>`` (allowed as the reply's first
            token) and ``<channel|>`` (the constraint starts after it), or None.
    """

    def __init__(self, tokenizer, grammar: str, stop_ids, *, start_active: bool = True,
                 channel_open: int | None = None, channel_close: int | None = None):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(_ll_tokenizer(tokenizer, frozenset(stop_ids)), grammar)
        if self.matcher.is_error():
            raise GrammarError(f"response_format: {self.matcher.get_error()}")
        self.active, self.channel_open, self.channel_close = start_active, channel_open, channel_close
        self.first = start_active  # the reply's first token: it may open the reasoning channel

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[V]`` with every id the grammar forbids at -inf (a new tensor)."""
        if not self.active:
            return logits
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8) > 0
        if self.first and self.channel_open is not None and self.channel_open < allowed.numel():
            allowed[self.channel_open] = True
        out = logits.float().clone()
        out[: allowed.numel()][~allowed] = float("-inf")
        out[allowed.numel():] = float("-inf")  # ids past the tokenizer (padded embedding rows)
        return out

    def advance(self, token: int) -> None:
        """Take the generated ``token``."""
        first, self.first = self.first, False
        if first and token == self.channel_open:
            self.active = False
        elif not self.active:
            self.active = token == self.channel_close
        else:
            self.matcher.consume_token(token)
