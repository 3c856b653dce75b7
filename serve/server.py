"""OpenAI-compatible HTTP front (FastAPI + uvicorn) for a g4 :class:`~g4.serve.engine.Engine`.

Endpoints: ``POST /v1/chat/completions`` (the checkpoint's chat template, reasoning channel to
``reasoning_content``) and ``POST /v1/completions`` (a text or token-id prompt, no template,
plain text out), both as JSON or, with ``"stream": true``, SSE ending in ``data: [DONE]``
(``stream_options.include_usage``: ``"usage": null`` on every chunk, then a chunk with empty
``choices`` and the usage); ``GET /v1/models``, ``GET /health``. Both generation endpoints share
the request checks, limits, stop handling, queue and disconnect handling below.

* Requests are generated one at a time by a single worker thread (the engine holds one model
  and one KV cache); the HTTP side is asynchronous, so any number of clients may connect and
  wait in the queue (at most ``max_queue`` waiting; more get 503). A client that disconnects
  (streaming or not) cancels its generation at the next token, or its queued job.
* Errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}``:

  - 400: malformed or too deeply nested JSON; out-of-range or unsupported parameters
    (``temperature`` < 0 or > 2, ``top_p`` outside (0, 1], ``max_tokens`` < 1 or beyond the
    context, ``n`` outside 1..``MAX_N``, ``top_logprobs`` outside 0..``MAX_LOGPROBS`` or without
    ``logprobs``, more than one prompt); a value of the wrong JSON type (types are
    strict: ``"12"`` is not 12, and ``enable_thinking`` must be a boolean); features not served
    (the legacy ``functions``, ``echo``, ``suffix``, a ``response_format`` other than text, JSON object or
    JSON schema (or a schema llguidance cannot compile), vLLM's
    ``continuous_usage_stats``); ``stream_options`` without ``stream``; unknown fields; empty or
    malformed ``messages``; template errors; token ids outside the vocabulary.
  - 404: an unknown model or route. 413: a body over ``max_body_bytes`` (checked from
    ``Content-Length`` and while reading, before any parsing).
  - 503: the queue is full, or the generation worker has stopped. 500: generation failed.

  The server keeps serving after each.
* ``/v1/models`` ``data[0].root`` is the absolute path of the served directory. Non-standard
  fields: ``data[0].g4_served_files`` (size and mtime of each file under root that can change
  what is served, when the engine loaded it, see :func:`~g4.serve.engine.served_file_stats`),
  ``data[0].g4_engine`` (the engine's arithmetic in words),
  ``choices[0].message.reasoning_content``, and with vLLM's ``return_token_ids`` the generated
  ids ``token_ids`` (stop id included; streamed: each chunk's own) and ``prompt_token_ids``
  where vLLM puts them.
* ``n`` > 1: the choices are generated one after another (the engine runs one sequence at a
  time) from one random generator, so they differ when sampling and a seeded request repeats
  all of them; streamed, every chunk names its choice's ``index`` and each choice ends with its
  own ``finish_reason``; ``usage.completion_tokens`` counts the tokens of all choices.
* Tool calls (chat): ``tools`` and the history's assistant ``tool_calls`` and ``role: "tool"``
  messages are rendered by the checkpoint's template in Gemma 4's format
  (:func:`g4.serve.chat.render_prompt`); ``tool_choice`` ``required`` / a named function
  prefills the call's opening (:func:`g4.serve.chat.tool_prefill_ids`); the reply's
  ``<|tool_call>...<tool_call|>`` blocks become ``message.tool_calls`` (streamed: one
  ``delta.tool_calls`` entry per call, whole) with ``finish_reason: "tool_calls"``, unless
  ``tool_choice`` is ``none`` (then, like markup that does not parse, they are content, as
  text; :class:`g4.serve.chat.ReplyParser`).
* Log-probabilities (chat: ``logprobs: true`` and ``top_logprobs`` k; completions:
  ``logprobs`` k) are those of the distribution each token was drawn from, after temperature,
  ``top_k`` and ``top_p`` (:func:`g4.serve.engine.sampling_logprobs`; greedy: the model's
  own), for every generated token as ``token_ids`` has them (reasoning and the stop token
  included), in OpenAI's shapes; an id the sampler cannot draw is reported at -9999.0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from g4.core.errors import a_or_an
from g4.core.prompt import completion_ids
from g4.serve.chat import (
    ChatError,
    ControlIds,
    Delta,
    ReplyParser,
    StopMatcher,
    openai_tools,
    render_prompt,
    tool_prefill_ids,
)
from g4.serve.engine import Engine, SamplingParams, request_generator
from g4.serve.grammar import GrammarError, JsonConstraint, json_grammar

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20  # 1 MiB
MAX_QUEUE = 64
OWNED_BY = {"cpu": "g4-cpu", "neuron": "g4-neuron"}
MAX_N = 16  # choices per request (generated one after another)
MAX_LOGPROBS = 20  # top_logprobs (chat) / logprobs (completions) at most, as OpenAI's chat API


class APIError(Exception):
    """An error answered as an OpenAI-style error object with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ChatMessage(BaseModel):
    """One message; an assistant's ``tool_calls`` and a tool message's ``tool_call_id`` are
    checked by :func:`g4.serve.chat.render_prompt`."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"{a_or_an(str(self.role))} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request (any other key is refused).

    ``include_usage``: every chunk carries ``"usage": null`` and a last chunk before ``[DONE]``
    has empty ``choices`` and the usage (OpenAI's contract). vLLM's ``continuous_usage_stats``
    (usage in every chunk) and OpenAI's ``include_obfuscation`` (random padding in every delta)
    are not served: only ``false`` (their no-op value) is accepted.
    """

    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = None

    @field_validator("continuous_usage_stats", "include_obfuscation")
    @classmethod
    def _only_the_no_op(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server (only false)")
        return v


class GenerationRequest(BaseModel):
    """Fields and checks shared by ``/v1/chat/completions`` and ``/v1/completions``.

    Types are strict (JSON as sent). Sampling and output fields that this server does not
    implement are typed here only to be refused by :func:`unsupported` when set to anything
    but their no-op value (:attr:`NO_OP`); of the other fields only :data:`IGNORED_FIELDS`
    (which do not change the answer) are accepted, anything else is refused (as OpenAI's API
    does). ``return_token_ids`` (vLLM's): the reply carries the generated ids (``token_ids``)
    and the prompt's (``prompt_token_ids``), streamed per chunk.
    """

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    return_token_ids: bool | None = None
    # Read only to refuse them (see unsupported()): answering without would silently differ.
    prompt_logprobs: int | None = None
    echo: bool | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    best_of: int | None = None
    stop_token_ids: list[int] | None = None

    # field -> its values that change nothing (None, i.e. null or absent, always does)
    NO_OP: ClassVar[dict[str, tuple]] = {
        "prompt_logprobs": (), "echo": (False,), "logit_bias": ({},), "presence_penalty": (0,),
        "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,),
        "ignore_eos": (False,), "best_of": (1,), "stop_token_ids": ([],)}

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}")
        return v

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    def requested_max_tokens(self) -> int | None:
        """The request's limit on generated tokens (``None``: up to the context)."""
        return self.max_tokens

    def top_logprobs_k(self) -> int | None:
        """How many most likely ids each position reports (None: no log-probabilities)."""
        return None


class ChatRequest(GenerationRequest):
    """The body of ``POST /v1/chat/completions`` (see :class:`GenerationRequest`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    # the legacy functions / function_call API is not served (tools / tool_choice are)
    NO_OP: ClassVar[dict[str, tuple]] = GenerationRequest.NO_OP | {
        "functions": ([],), "function_call": ("none", "auto")}

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v):
        if v:
            openai_tools(v)  # ChatError (a ValueError): a 400 naming tools
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info):
        tools = info.data.get("tools") or []
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise ValueError("tool_choice must be none, auto, required or a named function")
            if choice == "required" and not tools:
                raise ValueError("tool_choice required needs tools")
        elif choice is not None:
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
            if fn["name"] not in [t["function"]["name"] for t in tools]:
                raise ValueError(f"tool_choice names {fn['name']!r}, which is not one of the tools")
        return choice

    @field_validator("response_format")
    @classmethod
    def _not_with_a_forced_call(cls, v, info):
        forced = info.data.get("tool_choice") not in (None, "none", "auto")
        if forced and v and v.get("type", "text") != "text":
            raise ValueError("a JSON response_format cannot be combined with a forced tool call (tool_choice)")
        return v

    def parse_tool_calls(self) -> bool:
        """Whether the reply's tool-call blocks become ``tool_calls``: tools are declared and
        ``tool_choice`` is not ``none`` (with ``none`` any call markup is content, as text)."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("chat_template_kwargs")
    @classmethod
    def _thinking_is_bool(cls, v):
        if v and v.get("enable_thinking") is not None and not isinstance(v["enable_thinking"], bool):
            raise ValueError("enable_thinking must be true or false")  # "no" would be truthy in the template
        if v:  # null means "not given", as elsewhere in the API
            v = {k: x for k, x in v.items() if x is not None}
        return v

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    """The body of ``POST /v1/completions`` (see :class:`GenerationRequest`).

    ``prompt``: a string, the raw prompt in the model's own format (its control-token texts are
    control tokens, as vLLM reads them; untrusted text belongs in a chat message, where it is
    text), with exactly one ``<bos>`` whether or not it starts with one
    (:func:`g4.core.prompt.completion_ids`), or token ids used as they are; a list of one such prompt is that prompt
    (``n=1``: more than one prompt is refused). No chat template is applied.
    """

    prompt: Any = Field(...)  # checked by _one_prompt (a union type would name its members in errors)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    NO_OP: ClassVar[dict[str, tuple]] = GenerationRequest.NO_OP | {"suffix": ("",)}

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a list of one prompt
        elif isinstance(v, list) and any(isinstance(x, (str, list)) for x in v):
            raise ValueError("one prompt per request is supported")
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not all(type(x) is int for x in v):  # strict: true is not 1
            raise ValueError("the prompt must be a string or a list of token ids")
        if not v:
            raise ValueError("the prompt has no tokens")
        if min(v) < 0:
            raise ValueError("token ids are not negative")
        return v


# Request fields accepted and ignored: they do not change what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "request_id",
                            "priority"})


def unsupported(req: GenerationRequest) -> APIError | None:
    """A 400 for a request feature this server cannot honour (rather than ignoring it): a
    field of the request's ``NO_OP`` set to anything else, ``stream_options`` without
    streaming, or a field this server does not know
    (vLLM's ``bad_words``, ``guided_json``, OpenAI's ``reasoning_effort`` ...) and that is not in
    :data:`IGNORED_FIELDS`."""
    unknown = sorted(set(req.model_extra or {}) - IGNORED_FIELDS)
    if unknown:
        return APIError(400, f"{unknown[0]} is not supported by this server", param=unknown[0])
    for name, no_op in req.NO_OP.items():
        value = getattr(req, name)
        if value is not None and value not in no_op:
            return APIError(400, f"{name} is not supported by this server", param=name)
    if req.stream_options is not None and not req.stream:
        return APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return None


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "field required"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def _stopped_error() -> APIError:
    return APIError(503, "the generation worker has stopped", type="server_error", code="worker_stopped")


@dataclass
class _Job:
    """One request for the worker. ``chat``: the reply's reasoning channel goes to
    ``reasoning_content`` (chat completions); otherwise it is plain text (text completions)."""

    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    chat: bool = True
    n: int = 1  # choices, generated one after another
    top_logprobs: int | None = None  # None: no log-probabilities
    tools: bool = False  # tool-call blocks become tool_calls (ChatRequest.parse_tool_calls)
    grammar: str | None = None  # response_format's (g4.serve.grammar.json_grammar), or None
    thinking: bool = False  # chat_template_kwargs enable_thinking: the reply may open the reasoning channel
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, payload) -> None:
        """Hand ``(kind, payload)`` to the request's event loop (from any thread). Never raises:
        when that loop has closed, its client is gone and the job is marked cancelled."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # "Event loop is closed": the request ended (client left, server stopped)
            self.cancelled.set()


class GenerationWorker:
    """One thread that runs queued jobs through the engine, in order, one at a time.

    A job's events, for each of its ``n`` choices in turn: ``"delta"`` (payload: the choice's
    index, the new text as a :class:`Delta`, the ids generated since the previous delta and
    their :class:`~g4.serve.engine.TokenLogprobs`, or Nones), then exactly one ``"done"`` (a
    dict with ``index``, ``finish_reason``, ``token_ids`` and ``logprobs``, all of them,
    ``tail_ids`` and ``tail_logprobs``, those no delta carried); or, instead of the rest, one ``"error"`` (an
    :class:`APIError`), unless its request
    cancelled it first (its client left; the request has ended on its own): a job whose
    generation raises gets a 500 and the worker goes on; a job whose request's event loop has
    closed is cancelled, not fatal; jobs still queued when the thread ends for any reason get a
    503, so no request waits forever. Cancelled jobs do not count against ``max_queue``.
    :meth:`submit` after :meth:`close`, :meth:`abort` or the thread's end raises a 503.
    """

    def __init__(self, engine: Engine, max_queue: int = MAX_QUEUE):
        self.engine = engine
        self.control = ControlIds.from_tokenizer(engine.tokenizer)
        self.max_queue = max_queue
        self._cond = threading.Condition()  # guards everything below
        self._queue: deque[_Job] = deque()
        self._stopped = False  # no more submits; the thread ends once the queue is empty
        self._abort = False  # abort(): queued jobs are answered 503, not run
        self._current: _Job | None = None
        self.thread = threading.Thread(target=self._run, name="g4serve-generate", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        """Whether submitted jobs will still be run."""
        with self._cond:
            return not self._stopped

    @property
    def waiting(self) -> int:
        """Queued jobs that will still be run (cancelled ones excluded)."""
        with self._cond:
            return sum(not j.cancelled.is_set() for j in self._queue)

    def submit(self, job: _Job) -> None:
        """Queue ``job``.

        Raises:
            APIError: 503 when the worker has stopped or ``max_queue`` jobs are already waiting.
        """
        with self._cond:
            if self._stopped:
                raise _stopped_error()
            if len(self._queue) >= self.max_queue:  # drop the jobs whose clients have left
                self._queue = deque(j for j in self._queue if not j.cancelled.is_set())
            if len(self._queue) >= self.max_queue:
                raise APIError(503, f"server busy: {self.max_queue} requests already waiting",
                               type="server_error", code="server_busy")
            self._queue.append(job)
            self._cond.notify()

    def close(self) -> None:
        """Stop after the jobs already queued; later submits get 503."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def abort(self) -> None:
        """Stop now, without waiting (server shutdown; safe from the event loop's thread): the
        running job is cancelled at its next token, and it and every queued job get a 503."""
        with self._cond:
            self._stopped = self._abort = True
            current = self._current
            queued = list(self._queue)  # answered here, not when the thread next looks at the queue:
            self._queue.clear()  # under load that can be after uvicorn has cut the requests off
            self._cond.notify()
        for job in ([current] if current is not None else []) + queued:
            job.emit("error", _stopped_error())
            job.cancelled.set()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """:meth:`abort`, then wait up to ``timeout_s`` seconds for the thread.

        Returns:
            True when the thread has ended (torch is no longer running in it, so the process
            may exit without tearing down a running kernel).
        """
        self.abort()
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def _next(self) -> _Job | None:
        with self._cond:
            while True:
                if self._abort:
                    return None
                while self._queue:
                    job = self._queue.popleft()
                    if not job.cancelled.is_set():
                        self._current = job
                        return job
                if self._stopped:
                    return None
                self._cond.wait()

    def _run(self) -> None:
        try:
            while (job := self._next()) is not None:
                try:
                    self._generate(job)
                except Exception as e:  # report to the client; keep serving
                    log.exception("generation failed")
                    job.emit("error", APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                               type="server_error"))
                with self._cond:
                    self._current = None
        finally:
            with self._cond:
                self._stopped = True
                left = [j for j in (self._current, *self._queue) if j is not None]
                self._queue.clear()
                self._current = None
            for job in left:  # the thread is ending in the middle of a job, or with jobs queued
                job.emit("error", _stopped_error())

    def _generate(self, job: _Job) -> None:
        generator = request_generator(job.params)
        for index in range(job.n):
            if job.cancelled.is_set():
                return
            self._generate_choice(job, index, generator)

    def _generate_choice(self, job: _Job, index: int, generator) -> None:
        engine = self.engine
        parser = ReplyParser(engine.tokenizer, self.control, job.prompt_ids, channels=job.chat, tools=job.tools)
        called = False
        constraint = None if job.grammar is None else JsonConstraint(
            engine.tokenizer, job.grammar, engine.stop_ids, start_active=parser.state == "content",
            channel_open=self.control.channel_open if job.thinking else None, channel_close=self.control.channel_close)
        stopper = StopMatcher(job.stops)
        ids: list[int] = []
        lps: list = []
        sent = 0  # ids[:sent] went out with a delta
        for step in engine.generate_steps(job.prompt_ids, job.params, job.cancelled.is_set, top_logprobs=job.top_logprobs,
                                          generator=generator, constraint=constraint):
            ids.append(step.token)
            lps.append(step.logprobs)
            d = parser.feed(step.token)
            out = Delta(reasoning=d.reasoning, content=stopper.feed(d.content), tool_calls=d.tool_calls)
            called = called or bool(d.tool_calls)
            if out:
                job.emit("delta", (index, out, ids[sent:], lps[sent:]))
                sent = len(ids)
            if stopper.hit:
                break
        if job.cancelled.is_set():
            return  # its client has gone, or stop() has answered it
        tail = parser.finish()
        out = Delta(reasoning="" if stopper.hit else tail.reasoning,
                    content=stopper.feed(tail.content) + stopper.finish())
        if out:
            job.emit("delta", (index, out, ids[sent:], lps[sent:]))
            sent = len(ids)
        stopped = stopper.hit or bool(ids and ids[-1] in engine.stop_ids)
        finish = ("tool_calls" if called else "stop") if stopped else "length"
        job.emit("done", {"index": index, "finish_reason": finish, "token_ids": ids,
                          "logprobs": lps, "tail_ids": ids[sent:], "tail_logprobs": lps[sent:]})


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style error object (see the module docstring)."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        err = APIError(400, f"invalid request: {exc.errors()[0].get('msg', '')}")
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request, exc: ClientDisconnect):
        # the client left while sending its body: nobody reads this answer, nothing to log
        return JSONResponse(APIError(400, "client disconnected", code="client_disconnected").body(), 400)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error")
        err = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
        return JSONResponse(err.body(), status_code=500)


async def _read_request(request: Request, kind: type[GenerationRequest], max_body_bytes: int,
                        served_model_name: str) -> GenerationRequest:
    """The body of ``request`` as a validated ``kind``.

    Raises:
        APIError: 413 over ``max_body_bytes``; 400 malformed JSON, invalid or unsupported
            fields; 404 a model other than ``served_model_name``.
    """
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
        raise APIError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise APIError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = kind.model_validate(data, strict=True)  # JSON types as sent: "12" is not 12
    except ValidationError as e:
        raise _validation_error(e) from None
    if (err := unsupported(req)) is not None:
        raise err
    if req.model is not None and req.model != served_model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served_model_name!r}",
                       param="model", code="model_not_found")
    return req


def prepare(engine: Engine, req: GenerationRequest) -> tuple[list[int], SamplingParams, list[str]]:
    """``(prompt ids, sampling params, stop strings)`` of a request: a chat rendered with the
    checkpoint's template, a text prompt tokenized (or its token ids checked); limits checked
    against the context, unset sampling fields taken from the checkpoint's defaults.

    Raises:
        APIError: 400 for a prompt that cannot be rendered, ids outside the vocabulary, or a
            prompt (plus ``max_tokens``) over the context.
    """
    if isinstance(req, ChatRequest):
        param = "messages"
        try:
            prompt_ids = render_prompt(engine.tokenizer, [m.model_dump() for m in req.messages],
                                       req.chat_template_kwargs, req.tools)
            if req.tools:
                prompt_ids += tool_prefill_ids(engine.tokenizer, ControlIds.from_tokenizer(engine.tokenizer),
                                               req.tool_choice)
        except ChatError as e:
            raise APIError(400, str(e), param=param) from e
    else:
        param = "prompt"
        if isinstance(req.prompt, str):
            prompt_ids = completion_ids(engine.tokenizer, req.prompt)
        else:
            prompt_ids = req.prompt
            vocab = len(engine.tokenizer)
            if max(prompt_ids) >= vocab:
                raise APIError(400, f"token id {max(prompt_ids)} is outside the vocabulary of {vocab} ids",
                               param=param)
    room = engine.max_context - len(prompt_ids)
    if room < 1:
        raise APIError(400, f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                            f"{engine.max_context} tokens", param=param, code="context_length_exceeded")
    max_tokens = req.requested_max_tokens()
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"max_tokens {max_tokens} plus the {len(prompt_ids)} prompt tokens exceeds the "
                            f"model's context of {engine.max_context} tokens", param="max_tokens",
                       code="context_length_exceeded")
    d = engine.defaults
    top_k = req.top_k if req.top_k is not None else d.get("top_k", 0)
    params = SamplingParams(
        max_tokens=max_tokens or room,
        temperature=req.temperature if req.temperature is not None else float(d.get("temperature", 1.0)),
        top_p=req.top_p if req.top_p is not None else float(d.get("top_p", 1.0)),
        top_k=max(int(top_k), 0), seed=None if req.seed is None else req.seed % (1 << 64))
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return prompt_ids, params, stops


class _Reply:
    """The response bodies of one request: a chat completion (``chat.completion`` and its
    chunks) or a text completion (``text_completion``), as OpenAI shapes them, with vLLM's
    ``token_ids`` / ``prompt_token_ids`` when ``return_token_ids`` is set (vLLM's places: for
    chat the prompt ids at the top level, for text completions in the choice), one choice per
    ``index`` and log-probabilities when asked (chat: ``choice.logprobs.content``; completions:
    ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``)."""

    def __init__(self, req: GenerationRequest, prompt_ids: list[int], model: str, tokenizer):
        self.chat, self.prompt_ids, self.tokenizer = isinstance(req, ChatRequest), prompt_ids, tokenizer
        self.ids = bool(req.return_token_ids)
        self.k = req.top_logprobs_k()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.head = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion" if self.chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.chunk_head = self.head | {"object": "chat.completion.chunk" if self.chat else "text_completion"}
        self.first = True  # no chunk sent yet
        self.started: set[int] = set()  # choices whose opening chunk (chat: the role) went out
        self.text_offset: dict[int, int] = {}  # completions: characters of token text so far, per choice

    def usage(self, generated: int) -> dict:
        """OpenAI's ``usage`` for ``generated`` tokens (all choices)."""
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": generated,
                "total_tokens": len(self.prompt_ids) + generated}

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _logprobs(self, index: int, ids: list[int], lps: list) -> dict | None:
        if self.k is None:
            return None
        texts = [self._text(t) for t in ids]
        if self.chat:
            def entry(text: str, logprob: float) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
            return {"content": [entry(text, lp.logprob) | {"top_logprobs": [entry(self._text(j), v) for j, v in lp.top]}
                                for text, lp in zip(texts, lps)], "refusal": None}
        offsets = []
        for text in texts:
            offsets.append(self.text_offset.get(index, 0))
            self.text_offset[index] = offsets[-1] + len(text)
        return {"tokens": texts, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._text(j): v for j, v in lp.top} for lp in lps], "text_offset": offsets}

    def _choice(self, index: int, text: Delta, finish_reason, ids: list[int], lps: list,
                stream: bool) -> tuple[dict, dict]:
        """``(choice, top-level extras)``."""
        choice: dict = {"index": index}
        top: dict = {}
        if not self.chat:
            choice["text"] = text.content
        elif stream:
            choice["delta"] = {k: v for k, v in (("reasoning_content", text.reasoning), ("content", text.content))
                               if v}
            if text.tool_calls:  # each call whole, in one delta: index, id, type, name, arguments
                choice["delta"]["tool_calls"] = [{"index": c.index} | c.openai() for c in text.tool_calls]
        else:
            choice["message"] = {"role": "assistant", "content": text.content,
                                 "reasoning_content": text.reasoning or None}
            if text.tool_calls:
                choice["message"] |= {"content": text.content or None,
                                      "tool_calls": [c.openai() for c in text.tool_calls]}
        choice |= {"finish_reason": finish_reason, "logprobs": self._logprobs(index, ids, lps)}
        if self.ids:
            choice["token_ids"] = ids
            if not stream or self.first:
                (top if self.chat else choice)["prompt_token_ids"] = self.prompt_ids
        return choice, top

    def body(self, texts: dict[int, Delta], dones: dict[int, dict]) -> dict:
        """The non-streamed response: choice ``i`` from ``texts[i]`` and its ``"done"`` payload."""
        choices, top = [], {}
        for i in sorted(dones):
            choice, extra = self._choice(i, texts[i], dones[i]["finish_reason"], dones[i]["token_ids"],
                                         dones[i]["logprobs"], stream=False)
            choices.append(choice)
            top |= extra
        generated = sum(len(d["token_ids"]) for d in dones.values())
        return self.head | top | {"choices": choices, "usage": self.usage(generated)}

    def chunk(self, index: int, text: Delta, ids: list[int], lps: list, finish_reason=None) -> str:
        """SSE events with new text of choice ``index``; a chat choice's first events are
        preceded by its opening chunk (``delta.role``)."""
        out = "" if not self.chat or index in self.started else self.opening(index)
        self.started.add(index)
        choice, top = self._choice(index, text, finish_reason, ids, lps, stream=True)
        return out + self._event(choice, top)

    def opening(self, index: int) -> str:
        """A chat choice's opening chunk: ``{"role": "assistant", "content": ""}``."""
        self.started.add(index)
        choice, top = self._choice(index, Delta(), None, [], [], stream=True)
        choice["delta"] = {"role": "assistant", "content": ""}
        return self._event(choice, top)

    def _event(self, choice: dict, top: dict) -> str:
        self.first = False
        body = self.chunk_head | top | {"choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    def usage_chunk(self, generated: int) -> str:
        """The last event before ``[DONE]`` with ``include_usage``: no choices, the usage."""
        return f"data: {json.dumps(self.chunk_head | {'choices': [], 'usage': self.usage(generated)})}\n\n"


async def _respond(request: Request, worker: GenerationWorker, req: GenerationRequest, engine: Engine,
                   model: str):
    """Queue the request's job and answer it: JSON, or SSE ending in ``data: [DONE]``. A client
    that leaves cancels its job (queued or generating)."""
    prompt_ids, params, stops = await run_in_threadpool(prepare, engine, req)
    n = req.n or 1
    try:
        grammar = json_grammar(req.response_format) if getattr(req, "response_format", None) else None
    except GrammarError as e:
        raise APIError(400, str(e), param="response_format") from e
    job = _Job(prompt_ids, params, stops, asyncio.get_running_loop(), asyncio.Queue(),
               chat=isinstance(req, ChatRequest), n=n, top_logprobs=req.top_logprobs_k(), grammar=grammar,
               thinking=bool(getattr(req, "chat_template_kwargs", None) and req.chat_template_kwargs.get("enable_thinking")),
               tools=isinstance(req, ChatRequest) and req.parse_tool_calls())
    worker.submit(job)
    reply = _Reply(req, prompt_ids, model, engine.tokenizer)
    if not req.stream:
        texts = {i: Delta() for i in range(n)}
        dones: dict[int, dict] = {}

        async def cancel_on_disconnect():
            # The body has been read, so the next ASGI message is http.disconnect: the client
            # left (or the response was sent). A job whose client left is not generated.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancelled.set()  # the worker skips it, or stops it at the next token
            job.events.put_nowait(("gone", None))  # and this request ends now, queued or not

        watcher = asyncio.create_task(cancel_on_disconnect())
        try:
            while len(dones) < n:
                kind, payload = await job.events.get()
                if kind == "delta":
                    texts[payload[0]] += payload[1]
                elif kind == "error":
                    raise payload
                elif kind == "gone":
                    raise ClientDisconnect()  # answered quietly; nobody reads it
                else:
                    dones[payload["index"]] = payload
        finally:
            watcher.cancel()
            job.cancelled.set()  # no-op when finished; stops generation if the client went away
        return reply.body(texts, dones)

    async def events():
        try:
            if reply.chat:
                yield reply.opening(0)
            finished, generated = 0, 0
            while finished < n:
                kind, payload = await job.events.get()
                if kind == "delta":
                    yield reply.chunk(*payload)
                elif kind == "error":
                    yield f"data: {json.dumps(payload.body())}\n\n"
                    break
                else:
                    yield reply.chunk(payload["index"], Delta(), payload["tail_ids"], payload["tail_logprobs"],
                                      payload["finish_reason"])
                    finished, generated = finished + 1, generated + len(payload["token_ids"])
            if finished == n and reply.include_usage:
                yield reply.usage_chunk(generated)
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(engine: Engine, *, served_model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
               max_queue: int = MAX_QUEUE):
    """The FastAPI application serving ``engine`` as model ``served_model_name``.

    ``app.state.worker`` is the :class:`GenerationWorker` (a daemon thread that lives as long as
    the process, or until ``app.state.worker.close()``).
    """
    worker = GenerationWorker(engine, max_queue=max_queue)
    created = int(time.time())

    # The worker outlives any one uvicorn run: an app may be served several times (tests, the
    # benchmark, `g4serve check --url` against an in-process server); it is an idle daemon thread.
    app = FastAPI(title="g4serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.engine = engine
    app.state.served_model_name = served_model_name
    _install_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created,
            "owned_by": OWNED_BY.get(engine.backend, engine.backend), "root": str(engine.path),
            "max_model_len": engine.max_context, "g4_engine": engine.description,
            "g4_served_files": engine.served_files}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _read_request(request, ChatRequest, max_body_bytes, served_model_name)
        return await _respond(request, worker, req, engine, served_model_name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _read_request(request, CompletionRequest, max_body_bytes, served_model_name)
        return await _respond(request, worker, req, engine, served_model_name)

    return app


class _QuietCancellation(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" records whose exception is a
    cancellation: at a shutdown past its timeout uvicorn cancels the requests still open and
    says so in one line; a traceback per request adds nothing (and floods the log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


# Seconds between the worker's abort (every open request is then answered 503) and uvicorn
# cancelling the requests still open: the time the event loop has to send those answers. At
# 2 s, a test with 60 open requests on 2 busy cores saw uvicorn's own 500s instead.
CUT_OFF_S = 5.0


def run_server(app, sock, *, drain_s: float = 30.0, log_level: str = "warning") -> None:
    """Serve ``app`` on the bound socket ``sock`` until SIGINT/SIGTERM (uvicorn, in this thread).

    Shutdown: new connections are refused at once; requests in flight get ``drain_s`` seconds
    (a second Ctrl-C: none). Then the generation worker is aborted, so every request still
    generating or queued is answered with a 503 (an OpenAI error object, or an SSE error event
    and ``[DONE]``); ``CUT_OFF_S`` later uvicorn cancels whatever is still open (clients stalled
    mid-request).
    Returns after the worker thread has ended; uvicorn re-raises the signal on return (see
    ``uvicorn.Server.capture_signals``).
    """
    import uvicorn

    worker: GenerationWorker = app.state.worker

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            async def drain_then_abort():
                loop = asyncio.get_running_loop()
                deadline = loop.time() + drain_s
                while loop.time() < deadline and not self.force_exit:
                    await asyncio.sleep(0.05)
                worker.abort()

            aborter = asyncio.create_task(drain_then_abort())
            try:
                await super().shutdown(sockets)
            finally:
                aborter.cancel()
                worker.abort()

    # lifespan off: the app has no startup/shutdown hooks, and a forced quit would otherwise log
    # the cancelled lifespan task's traceback
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=drain_s + CUT_OFF_S)
    logging.getLogger("uvicorn.error").addFilter(_QuietCancellation())
    try:
        _Server(config).run(sockets=[sock])
    finally:
        if not worker.stop(timeout_s=max(drain_s, 10.0)):
            log.warning("the generation thread did not stop within %.0f s", max(drain_s, 10.0))


class BackgroundServer:
    """uvicorn serving ``app`` on ``host`` in a daemon thread (for ``g4serve check``, tests and
    the benchmark). ``port=0`` takes a free port; :attr:`url` is ``http://host:port``.

    Use as a context manager; leaving it stops the server and waits for the thread.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import socket

        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.app = app
        # a client that never finishes its request must not hold stop() (and a test) forever
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="g4serve-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        """Start and wait until uvicorn accepts connections.

        Raises:
            RuntimeError: not started within ``timeout_s`` seconds.
        """
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
