"""CPU generation engines behind ``g4serve``: one interface, three checkpoint formats.

* :class:`HFEngine`: a transformers Gemma 4 model with a KV cache (transformers'
  ``DynamicCache``, sliding layers included). Built from the result's **own** ``config.json``
  (there is no SRC at serving time): an NVFP4 result is dequantized by
  :func:`g4.convert.reference.load_nvfp4_as_hf` into transformers' layout, a bf16 checkpoint is
  loaded as it is.
* :class:`StreamedEngine`: an NVFP4 result or a bf16 checkpoint too large for this host's
  memory, run one decoder layer at a time (:mod:`g4.convert.stream`, as ``g4convert verify``):
  every generated token reads (and dequantizes) every layer once, so it is slow but needs
  about one layer of RAM. :func:`load_cpu_engine` picks it when the whole model would not fit
  (:func:`whole_model_fits`).
* :class:`EmulatorEngine`: an int8-neuron result through
  :class:`g4.serve.neuron_emulator.NeuronEmulator` (tensor-parallel ranks emulated on the
  CPU; no KV cache, every step recomputes the whole sequence). Its weights stay int8 and are
  dequantized on use, a layer at a time; the rank files are held in RAM, or, when they would
  not fit (:func:`whole_model_fits`), read from disk one layer at a time on every step.

An engine only turns prompt ids into generated ids (:meth:`Engine.generate`); chat
rendering and reply parsing live in ``g4.serve.chat``, HTTP in ``g4.serve.server``. Other
backends (``g4.serve.neuron_backend.NeuronEngine``) subclass :class:`Engine` and implement
:meth:`Engine.start` / :meth:`Engine.step`.

**W4A4 activation emulation.** A W4A4 NVFP4 result (``input_scale`` on every quantized
linear) is served by vLLM on Blackwell with each linear's input quantized to NVFP4 against
that static ``input_scale`` (vLLM ``vllm/model_executor/layers/quantization/modelopt.py``). The CPU
engine reproduces that by default (``act_quant=None`` means "on when the result has
input scales"), so the reference answers what the deployed model computes, including the
activation-quantization error the calibration was meant to bound; pass ``act_quant=False``
for the weight-only (W4A16, Hopper/Marlin) arithmetic.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from g4.convert.reference import load_converted_model, load_source_model, no_input_scales
from g4.convert.stream import Nvfp4Stream, SourceStream, decode_step, new_cache
from g4.core.checkpoint import CONFIG_NAME, Checkpoint
from g4.core.errors import CheckpointError
from g4.core.progress import progress_bar
from g4.exporters.formats import (
    BF16,
    CARD_FILE,
    EVAL_FILE,
    INT8_NEURON,
    NVFP4,
    VERIFICATION_FILE,
    ResultFormat,
    detect_format,
)
from g4.serve.neuron_emulator import NeuronEmulator, whole_model_bytes as emulator_bytes

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request.

    ``temperature`` 0 is greedy (argmax); otherwise softmax(logits / temperature) restricted to
    the ``top_k`` most likely ids (0 = all) and the smallest nucleus of mass >= ``top_p``.
    ``max_tokens``: generated tokens at most (stop id included). ``seed``: a fixed seed gives
    the same sample every time; ``None`` draws one.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


# Files under a served directory that do not change what it serves (written by check, eval and push).
NOT_SERVED = frozenset({VERIFICATION_FILE, EVAL_FILE, CARD_FILE})


def served_file_stats(root: Path) -> dict[str, dict[str, int]]:
    """``{relative path: {"bytes", "mtime_ns"}}`` of every file under ``root`` that can change
    what is served (weights, config, generation config, tokenizer, chat template, manifest:
    all but :data:`NOT_SERVED` and hidden files), sorted, taken when an engine loads them.
    ``/v1/models`` serves it as ``g4_served_files`` so that ``g4serve check --url`` can tell a
    server that loaded other (or since rewritten) files from one serving OUT as it is now,
    without hashing gigabytes."""
    root = Path(root)
    stats = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in NOT_SERVED and not any(part.startswith(".") for part in rel.split("/")):
            st = p.stat()
            stats[rel] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    return stats


# The log-probability reported for an id the sampler cannot draw (OpenAI's floor: JSON has no -inf).
LOGPROB_FLOOR = -9999.0


def _sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
    """Unnormalised fp32 probabilities ``[V]`` :func:`sample_next` draws from (zero outside
    ``top_k`` and the ``top_p`` nucleus), or None for greedy decoding (``temperature`` 0)."""
    if p.temperature == 0:
        return None
    logits = logits.float() / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the ids ranked above each one
        drop = before >= p.top_p
        drop[0] = False  # the top id always stays (a top_p below fp32's smallest value included)
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def sample_next(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose the next id from fp32 ``logits`` ``[V]`` under ``p``."""
    probs = _sampling_probs(logits, p)
    if probs is None:
        return int(logits.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def sampling_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Natural-log probabilities ``[V]`` fp32 of the distribution :func:`sample_next` draws the
    next id from: softmax(logits / temperature) restricted to ``top_k`` and the ``top_p``
    nucleus and renormalised (``-inf`` outside it), so they change with the sampling settings as
    the draw does (the known mistake is reporting the raw distribution whatever the temperature:
    vllm-project/vllm #9453, ollama/ollama #16196). Greedy decoding (``temperature`` 0) draws
    from no distribution; it reports the model's own, log_softmax(logits), as OpenAI does."""
    probs = _sampling_probs(logits, p)
    if probs is None:
        return torch.log_softmax(logits.float(), -1)
    return torch.log(probs / probs.sum())


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities of one generated position (:func:`sampling_logprobs`).

    ``logprob``: of the generated id; ``top``: the ``k`` most likely ids and their
    log-probabilities, most likely first; values below :data:`LOGPROB_FLOOR` (``-inf``) are
    reported as the floor.
    """

    logprob: float
    top: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, logprobs: torch.Tensor, token: int, k: int) -> "TokenLogprobs":
        top = torch.topk(logprobs, k) if k else None
        pairs = () if top is None else tuple((int(i), max(float(v), LOGPROB_FLOOR))
                                              for v, i in zip(top.values, top.indices))
        return cls(max(float(logprobs[token]), LOGPROB_FLOOR), pairs)


@dataclass(frozen=True)
class Step:
    """One generated id, with its :class:`TokenLogprobs` when they were asked for."""

    token: int
    logprobs: TokenLogprobs | None = None


def request_generator(params: SamplingParams) -> torch.Generator | None:
    """The random generator of one request (None for greedy decoding): seeded by ``params.seed``,
    else by a fresh random seed. A request with ``n`` choices draws them all from one generator,
    so its choices differ and a seeded request repeats all of them."""
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return torch.Generator().manual_seed(seed)


class Engine:
    """Generates token ids for prompt ids; ``max_batch_size`` sequences at a time (1: callers
    serialise; more: :meth:`start`, :meth:`step` and :meth:`finish` may be called from that many
    threads at once, each driving its own sequence, as :class:`StepBatcher` runs them).

    Attributes:
        backend: ``"cpu"`` (or ``"neuron"`` for the Neuron engine).
        description: one line, e.g. ``"NVFP4 W4A4 (modelopt) dequantized, W4A4 emulation, bfloat16"``.
        tokenizer: the checkpoint's tokenizer (with its chat template).
        stop_ids: generation stops after emitting one of these (``generation_config.json``
            ``eos_token_id``, the whole list: ``[1, 106, 50]`` for Gemma 4; ``<turn|>`` is
            added, with a warning, when that list lacks it).
        max_context: prompt plus generated tokens at most (``max_position_embeddings``).
        max_prompt: prompt tokens at most (``max_context`` unless an engine encodes shorter
            prompts: the neuron engine's largest context-encoding bucket).
        defaults: the checkpoint's sampling defaults from ``generation_config.json``
            (``temperature``, ``top_p``, ``top_k`` where given).
    """

    backend = "cpu"
    max_batch_size = 1

    def __init__(self, path: Path, tokenizer, description: str):
        self.path, self.tokenizer, self.description = Path(path).resolve(), tokenizer, description
        self.served_files = served_file_stats(self.path)
        gen = _read_json_if(self.path / "generation_config.json")
        config = _read_json_if(self.path / CONFIG_NAME)
        text = config.get("text_config") or config
        eos = gen.get("eos_token_id", text.get("eos_token_id", config.get("eos_token_id")))
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and not eos:
            eos = [tokenizer.eos_token_id]
        end_of_turn = tokenizer.convert_tokens_to_ids("<turn|>")  # Gemma 4's end of turn (106), a stop id
        if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id and end_of_turn not in eos:
            log.warning("%s: stop ids %s lack <turn|> (%d); stopping at it too (generation_config.json missing "
                        "or incomplete)", self.path, eos, end_of_turn)
            eos = [*eos, end_of_turn]
        self.stop_ids = frozenset(int(i) for i in eos)
        self.max_context = max_context(config)
        self.max_prompt = self.max_context
        self.defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}

    def start(self, prompt_ids: list[int]):
        """Run the prompt; return ``(state, logits [V] fp32)`` for the first generated position."""
        raise NotImplementedError

    def step(self, state, token: int):
        """Append ``token``; return ``(state, logits [V] fp32)`` for the next position."""
        raise NotImplementedError

    def finish(self, state) -> None:
        """The sequence of ``state`` (from :meth:`start` or :meth:`step`) will not be stepped again:
        a batched engine frees its KV cache slot. Called once per started sequence, also when it
        ends by an error; nothing to do for an engine whose state holds its own cache."""

    @torch.no_grad()
    def generate_steps(self, prompt_ids: list[int], params: SamplingParams,
              should_stop: Callable[[], bool] = lambda: False, *, top_logprobs: int | None = None,
              generator: torch.Generator | None = None, constraint=None) -> Iterator[Step]:
        """Yield generated ids one at a time until a stop id (yielded too), ``params.max_tokens``
        ids, or ``should_stop()`` (checked before each step, e.g. a disconnected client).

        Args:
            top_logprobs: None for no log-probabilities; else each :class:`Step` carries the
                generated id's and the ``top_logprobs`` most likely ids' (0 <= k <= V).
            generator: the request's (:func:`request_generator`); None makes one from
                ``params``.
            constraint: a grammar (:class:`g4.serve.grammar.JsonConstraint`: ``mask(logits)``
                before each draw, ``advance(token)`` after it), or None.
        """
        if generator is None:
            generator = request_generator(params)
        state, logits = self.start(list(prompt_ids))
        try:
            for n in range(params.max_tokens):
                if constraint is not None:
                    logits = constraint.mask(logits)
                token = sample_next(logits, params, generator)
                if constraint is not None:
                    constraint.advance(token)
                lp = None if top_logprobs is None else TokenLogprobs.of(sampling_logprobs(logits, params), token,
                                                                         top_logprobs)
                yield Step(token, lp)
                if token in self.stop_ids or n + 1 == params.max_tokens or should_stop():
                    return
                state, logits = self.step(state, token)
        finally:  # also when the caller closes the generator early (a stop string, a client gone)
            self.finish(state)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 should_stop: Callable[[], bool] = lambda: False) -> Iterator[int]:
        """The ids of :meth:`generate_steps`."""
        return (s.token for s in self.generate_steps(prompt_ids, params, should_stop))


class _Call:
    """One sequence's call waiting in a :class:`StepBatcher`: a context encoding (``ids``) or a
    token generation (``position``, ``token``); ``logits`` or ``error`` once run."""

    __slots__ = ("slot", "ids", "position", "token", "logits", "error", "done")

    def __init__(self, slot: int, ids: list[int] | None = None, position: int = 0, token: int = 0):
        self.slot, self.ids, self.position, self.token = slot, ids, position, token
        self.logits, self.error, self.done = None, None, False


class StepBatcher:
    """Continuous batching for an engine whose backend runs one sequence's context encoding into a
    KV cache slot, and one token generation for several slots in one call (NxDI's
    ``is_continuous_batching``: context encoding at ``ctx_batch_size`` 1 with ``seq_ids = [slot]``,
    token generation at ``tkg_batch_size`` B with one row per slot; aws-neuron/
    neuronx-distributed-inference ``src/neuronx_distributed_inference/models/model_wrapper.py``,
    ``_forward_with_pad``, which pads the rows of idle slots).

    Each sequence is driven by its own thread (:meth:`start`, then :meth:`step` per token, then
    :meth:`finish`), as the server's workers drive :meth:`Engine.generate_steps`. The batcher
    coalesces them: a waiting context encoding runs first (one at a time: a new request's first
    token is not delayed by the others' decoding); otherwise token generation runs once every
    sequence holding a slot is waiting to step, all of them in one call, so B sequences decode in
    about the time of one. Whichever waiting thread finds the backend idle runs the call and hands
    each thread its row. A backend error reaches every thread of that call.

    Args:
        max_batch_size: KV cache slots (B); a :meth:`start` waits while all are held.
        encode: ``encode(slot, ids)``: context encoding of ``ids`` (list of int, positions
            ``0..len-1``) into ``slot``; fp32 logits ``[V]`` of the last position.
        decode: ``decode(rows)``, rows a list of ``(slot, position, token)``: one token generation
            for those slots (each ``token`` at ``position``); fp32 logits ``[len(rows), V]``.

    State of a sequence: ``(slot, next position)``.
    """

    def __init__(self, max_batch_size: int, encode: Callable[[int, list[int]], torch.Tensor],
                 decode: Callable[[Sequence[tuple[int, int, int]]], torch.Tensor]):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, not {max_batch_size}")
        self.max_batch_size = max_batch_size
        self._encode, self._decode = encode, decode
        self._cv = threading.Condition()
        self._free = list(range(max_batch_size))
        self._encodes: deque[_Call] = deque()
        self._decodes: list[_Call] = []
        self._between = 0  # sequences holding a slot that are neither waiting nor being run
        self._busy = False
        self.decode_batches: list[int] = []  # rows of each token-generation call, in order (stats, tests)

    @property
    def active(self) -> int:
        """Sequences holding a slot."""
        with self._cv:
            return self.max_batch_size - len(self._free)

    def start(self, ids: list[int]):
        """Take the lowest free slot (waiting for one) and run ``ids``' context encoding into it.
        Returns ``((slot, len(ids)), logits [V] fp32)``; on an error the slot is free again."""
        with self._cv:
            self._cv.wait_for(lambda: self._free)
            call = _Call(self._free.pop(0), ids=list(ids))
            self._encodes.append(call)
            self._wait(call)
            if call.error is not None:
                self._release(call.slot)
                raise call.error
        return (call.slot, len(ids)), call.logits

    def step(self, state, token: int):
        """Token generation of ``token`` at the state's position, batched with the other
        sequences' steps. Returns ``((slot, position + 1), logits [V] fp32)``."""
        slot, position = state
        with self._cv:
            self._between -= 1
            call = _Call(slot, position=position, token=int(token))
            self._decodes.append(call)
            self._wait(call)
            if call.error is not None:
                raise call.error  # the slot stays held until finish()
        return (slot, position + 1), call.logits

    def finish(self, state) -> None:
        """The sequence of ``state`` ends: its slot is free for the next :meth:`start`."""
        with self._cv:
            self._between -= 1
            self._release(state[0])

    def _release(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort()
        self._cv.notify_all()

    def _runnable(self) -> list[_Call] | None:
        """The next call to run, or None: the oldest context encoding, else every waiting token
        generation once no sequence holding a slot is between its calls."""
        if self._busy:
            return None
        if self._encodes:
            return [self._encodes.popleft()]
        if self._decodes and self._between == 0:
            batch, self._decodes = sorted(self._decodes, key=lambda c: c.slot), []
            return batch
        return None

    def _wait(self, call: _Call) -> None:
        """With the lock held: until ``call`` has run, running whatever is runnable meanwhile."""
        while not call.done:
            batch = self._runnable()
            if batch is None:
                self._cv.wait()
                continue
            self._busy = True
            self._cv.release()
            logits, error = None, None
            try:
                if batch[0].ids is not None:
                    logits = self._encode(batch[0].slot, batch[0].ids)[None]
                else:
                    self.decode_batches.append(len(batch))
                    logits = self._decode([(c.slot, c.position, c.token) for c in batch])
            except BaseException as e:  # handed to every sequence of this call
                error = e
            finally:
                self._cv.acquire()
                self._busy = False
            for i, c in enumerate(batch):
                c.done = True
                if error is not None:
                    c.error = error
                else:
                    c.logits = logits[i]
            # counted as between their calls from now, not from when each thread wakes: else the
            # first to wake would run its next step alone while the others still sleep
            if error is None or batch[0].ids is None:  # a failed start frees its slot instead
                self._between += len(batch)
            self._cv.notify_all()


class HFEngine(Engine):
    """A transformers Gemma 4 model with a KV cache.

    Args:
        model: ``Gemma4ForConditionalGeneration`` or ``Gemma4ForCausalLM`` in eval mode.
    """

    def __init__(self, path: Path, model, tokenizer, description: str):
        super().__init__(path, tokenizer, description)
        self.model = model

    def start(self, prompt_ids):
        out = self.model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        return out.cache, out.logits[0, -1].float()

    def step(self, state, token):
        out = self.model(input_ids=torch.tensor([[token]]), cache=state, use_cache=True)
        return out.cache, out.logits[0, -1].float()


class StreamedEngine(Engine):
    """A Gemma 4 model run one decoder layer at a time, with a transformers ``DynamicCache`` per
    request (:func:`g4.convert.stream.decode_step`).

    Args:
        model: a :class:`g4.convert.stream.StreamedModel` (source or NVFP4 result).
    """

    def __init__(self, path: Path, model, tokenizer, description: str):
        super().__init__(path, tokenizer, description)
        self.model = model

    def start(self, prompt_ids):
        cache = new_cache(self.model)
        return (cache, len(prompt_ids)), decode_step(self.model, cache, prompt_ids, 0)

    def step(self, state, token):
        cache, past = state
        return (cache, past + 1), decode_step(self.model, cache, [token], past)


def available_memory_bytes(root: Path = Path("/")) -> int | None:
    """Bytes this process can still allocate: the host's ``MemAvailable`` (``/proc/meminfo``), or
    less where the process's memory cgroup has a limit (a container or ``systemd-run -p
    MemoryMax=``, where ``/proc/meminfo`` still shows the whole host): the limit minus the
    cgroup's usage plus its reclaimable page cache (``inactive_file``). cgroup v2
    (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``, ``total_inactive_file``). ``None`` where ``MemAvailable`` cannot
    be read. ``root``: where ``/proc`` and ``/sys`` are (tests)."""
    try:
        meminfo = (root / "proc/meminfo").read_text()
        available = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:"))) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        groups = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return available
    for line in groups:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2
            base, files = root / "sys/fs/cgroup" / path.lstrip("/"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            base = root / "sys/fs/cgroup/memory" / path.lstrip("/")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        try:
            limit_text = (base / files[0]).read_text().strip()
            if limit_text == "max" or int(limit_text) >= 1 << 60:
                continue
            used = int((base / files[1]).read_text())
            stat = dict(line.split() for line in (base / "memory.stat").read_text().splitlines() if " " in line)
            reclaimable = int(stat.get(files[2], 0))
        except (OSError, ValueError):
            continue
        available = min(available, max(0, int(limit_text) - used + reclaimable))
    return available


def whole_model_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes the whole-model CPU engine of the result in ``path`` needs, computed from its headers:

    * NVFP4 or bf16 (:class:`HFEngine`): twice the model dequantized to ``dtype`` (loading holds
      the model's own parameters and the dequantized state dict side by side; on the 2-layer
      NVFP4 synthetic 26B this says 11.39 GiB, the anonymous memory peaked at 11.49 GiB; the
      result's memory-mapped pages, 3.4 GiB more of resident set, are reclaimable page cache);
    * int8-neuron (:class:`EmulatorEngine` with ``stream=False``): the rank files' tensors as
      stored plus one rank's lm_head slice in ``dtype``
      (:func:`g4.serve.neuron_emulator.whole_model_bytes`; layers are dequantized on use).

    Raises:
        CheckpointError: unreadable headers, or an int8-neuron result that differs from its layout.
    """
    if detect_format(path).format == INT8_NEURON:
        return emulator_bytes(path, dtype)
    # an NVFP4 uint8 byte holds two weights
    params = sum(info.nbytes * 2 if info.dtype == torch.uint8 else info.nbytes // info.dtype.itemsize
                 for info in Checkpoint(path).tensors.values())
    return 2 * params * dtype.itemsize


def whole_model_fits(path: Path, dtype: torch.dtype) -> bool:
    """Whether the whole-model CPU engine of the result in ``path`` (:func:`whole_model_bytes`)
    fits into the memory this process can still allocate (:func:`available_memory_bytes`:
    ``MemAvailable``, or a memory cgroup's room where that is less; True where neither can be
    read). :func:`load_cpu_engine` runs the model one decoder layer at a time when it does not."""
    available = available_memory_bytes()
    return available is None or whole_model_bytes(path, dtype) <= available


class EmulatorEngine(Engine):
    """An int8-neuron result on the CPU through the tensor-parallel emulator (full recompute
    per step: fine for tiny models, slow for real ones)."""

    def __init__(self, path: Path, emulator, tokenizer, description: str):
        super().__init__(path, tokenizer, description)
        self.emulator = emulator

    def start(self, prompt_ids):
        ids = torch.tensor([prompt_ids])
        return ids, self.emulator(ids)[0, -1]

    def step(self, state, token):
        ids = torch.cat([state, torch.tensor([[token]])], dim=1)
        return ids, self.emulator(ids)[0, -1]


def _read_json_if(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def max_context(config: dict) -> int:
    """Tokens of context (prompt plus reply) of a checkpoint's parsed ``config.json``:
    ``max_position_embeddings`` (``text_config`` first), 2048 when absent."""
    text = config.get("text_config") or config
    return int(text.get("max_position_embeddings") or 2048)


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer and chat template.

    Raises:
        CheckpointError: missing or unloadable tokenizer files, or no chat template (case P14).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # many exception types for a missing or broken tokenizer
        tokenizer = None
        if (Path(path) / "tokenizer.json").is_file():
            # transformers < 5 (4.57 beside the Neuron SDK's NxDI) does not know the
            # ``TokenizersBackend`` class that transformers 5 writes into tokenizer_config.json;
            # the same tokenizer.json, special tokens and chat template load as a fast tokenizer.
            try:
                tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
            except Exception:  # noqa: BLE001  (the first error is the one reported)
                pass
        if tokenizer is None:
            raise CheckpointError(f"{path}: serving needs its tokenizer and it cannot be loaded "
                                  f"({type(e).__name__}: {e})") from e
    if not getattr(tokenizer, "chat_template", None):
        raise CheckpointError(f"{path}: no chat template (chat_template.jinja); chat completions need it")
    return tokenizer


def build_hf_model(path: Path, fmt: ResultFormat, dtype: torch.dtype, act_quant: bool, *, progress: bool = False):
    """transformers model of an NVFP4 result (dequantized) or a bf16 checkpoint, built from
    the directory's own config.json. ``progress``: a bar on stderr while the weights load (NVFP4:
    g4's, over the stored bytes read and dequantized; bf16: transformers' own, per tensor).

    Raises:
        CheckpointError: tensors that do not cover the model exactly (:func:`g4.convert.reference.load_converted_model`).
    """
    from transformers.utils import logging as hf_logging

    if fmt.format == BF16:
        was = hf_logging.is_progress_bar_enabled()
        if progress:  # g4serve turns the libraries' bars off; this one is the load's
            with warnings.catch_warnings():  # huggingface_hub warns that HF_HUB_DISABLE_PROGRESS_BARS keeps its own off
                warnings.simplefilter("ignore", UserWarning)
                hf_logging.enable_progress_bar()
        try:
            return load_source_model(path, dtype)
        finally:
            if not was:
                hf_logging.disable_progress_bar()
    with progress_bar(sum(info.nbytes for info in Checkpoint(path).tensors.values()), f"loading {path.name}",
                      enabled=progress) as bar:
        return load_converted_model(path, None, dtype, act_quant=act_quant, on_read=bar.update)


def load_cpu_engine(path: str | Path, *, act_quant: bool | None = None, dtype: str = "bfloat16",
                    fmt: ResultFormat | None = None, stream: bool | None = None, progress: bool = False) -> Engine:
    """The CPU engine for the result in ``path`` (format detected from its files).

    Args:
        act_quant: NVFP4 only: emulate W4A4 activation quantization; ``None`` = on exactly when
            the result is W4A4 (see the module docstring).
        dtype: ``"bfloat16"`` (what vLLM computes in) or ``"float32"`` for the transformers model;
            the int8-neuron emulator always computes in fp32.
        stream: run one decoder layer at a time, reading it from the files on every step
            (NVFP4 and bf16: :class:`StreamedEngine`; int8-neuron: the emulator with
            ``stream=True``); ``None`` = exactly when the whole model does not fit
            (:func:`whole_model_fits`).
        progress: a bar on stderr while a whole model loads (:func:`build_hf_model`).

    Raises:
        CheckpointError: unknown format, unreadable files, ``act_quant=True`` on a W4A16 result.
    """
    path = Path(path)
    fmt = fmt or detect_format(path)
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    tokenizer = load_tokenizer(path)
    if fmt.format == INT8_NEURON:
        if stream is None:
            stream = not whole_model_fits(path, torch.float32)
        emulator = NeuronEmulator(path, dtype=torch.float32, stream=stream)
        tp = emulator.manifest.tp_degree
        return EmulatorEngine(path, emulator, tokenizer, f"{fmt.detail}, TP={tp} emulated on CPU, float32"
                                                         + (", one decoder layer at a time" if stream else ""))
    if fmt.format == NVFP4:
        act_quant = fmt.w4a4 if act_quant is None else act_quant
        what = f"{fmt.detail} dequantized, {'W4A4 activation emulation' if act_quant else 'weight-only arithmetic'}"
    else:
        act_quant = False
        what = fmt.detail
    if stream is None:
        stream = not whole_model_fits(path, DTYPES[dtype])
    if stream:
        if fmt.format == NVFP4:
            if act_quant and not fmt.w4a4:
                raise no_input_scales(path)
            model = Nvfp4Stream(path, DTYPES[dtype], act_quant=bool(act_quant))
        else:
            model = SourceStream(path, DTYPES[dtype])
        return StreamedEngine(path, model, tokenizer, f"{what}, {dtype}, one decoder layer at a time")
    model = build_hf_model(path, fmt, DTYPES[dtype], bool(act_quant), progress=progress)
    return HFEngine(path, model, tokenizer, f"{what}, {dtype}")
