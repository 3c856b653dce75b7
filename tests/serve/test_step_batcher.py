"""Continuous batching on the host (:class:`g4.serve.engine.StepBatcher`, used by the neuron
backend with ``--max-batch-size B``): several threads' sequences share one backend whose token
generation runs all of them in one call, and each thread gets exactly the tokens it would get
alone. The backend here is a toy with a KV cache per slot whose next token depends on the whole
sequence, so a row handed to the wrong thread, a wrong position or a slot reused before it was
freed changes the tokens. NxDI's own continuous batching runs in ``tests/lanes/test_nxdi_gemma4.py``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from serve_fixtures import cpu_engine

from g4.serve.engine import Engine, SamplingParams, StepBatcher
from g4.serve.server import GenerationWorker, _Job

WAIT_S = 30
V = 97


class ToyBackend:
    """KV cache lines ``cache[slot]``: the ids at positions ``0..``; logits one-hot on a hash of
    the line. Records every call; ``fail_on`` (a call number) raises there."""

    def __init__(self, slots: int, vocab: list[int] | None = None):
        self.cache: list[list[int] | None] = [None] * slots
        self.vocab = vocab or list(range(V))
        self.calls: list[tuple] = []
        self.fail_on: int | None = None

    def _logits(self, line: list[int]) -> torch.Tensor:
        h = sum((i + 1) * t for i, t in enumerate(line)) % len(self.vocab)
        out = torch.full((max(self.vocab) + 1,), -1e4)
        out[self.vocab[h]] = 0.0
        return out

    def _call(self, what):
        self.calls.append(what)
        if self.fail_on == len(self.calls):
            raise RuntimeError(f"device error in call {len(self.calls)}")

    def encode(self, slot: int, ids: list[int]) -> torch.Tensor:
        self._call(("encode", slot, len(ids)))
        self.cache[slot] = list(ids)
        return self._logits(self.cache[slot])

    def decode(self, rows) -> torch.Tensor:
        self._call(("decode", [s for s, _, _ in rows]))
        out = []
        for slot, position, token in rows:
            line = self.cache[slot]
            assert line is not None and position == len(line), (slot, position, line)
            line.append(token)
            out.append(self._logits(line))
        return torch.stack(out)


def greedy(batcher: StepBatcher, prompt: list[int], n: int, *, ready: threading.Barrier | None = None,
           slots: list | None = None) -> list[int]:
    """``n`` greedy tokens of ``prompt``, as Engine.generate_steps drives an engine."""
    state, logits = batcher.start(prompt)
    if slots is not None:
        slots.append(state[0])
    if ready is not None:
        ready.wait(WAIT_S)
    out = []
    try:
        for _ in range(n):
            out.append(int(logits.argmax()))
            if len(out) == n:
                break
            state, logits = batcher.step(state, out[-1])
    finally:
        batcher.finish(state)
    return out


PROMPTS = [([5, 6, 7], 6), ([9], 3), ([1, 2, 3, 4, 5], 8), ([8, 8], 1), ([4, 3], 5), ([7, 1, 7], 4)]


def alone(prompt, n) -> list[int]:
    return greedy(StepBatcher(1, (b := ToyBackend(1)).encode, b.decode), prompt, n)


def run_threads(fn, count: int) -> list:
    results, errors = [None] * count, []

    def go(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            errors.append(e)
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a batched sequence hung"
    return results


def test_sequences_decoded_together_get_the_tokens_they_get_alone():
    """Four sequences of different lengths, started together: one context encoding each, then
    token generation in calls of as many rows as sequences still running (4, then fewer as the
    short ones end), each row back to its own thread."""
    prompts = PROMPTS[:4]
    backend = ToyBackend(4)
    batcher = StepBatcher(4, backend.encode, backend.decode)
    ready = threading.Barrier(4)
    got = run_threads(lambda i: greedy(batcher, *prompts[i], ready=ready), 4)
    assert got == [alone(*p) for p in prompts]
    steps = [n - 1 for _, n in prompts]  # token-generation calls each sequence needs
    assert batcher.decode_batches == [sum(s > k for s in steps) for k in range(max(steps))]
    assert sum(1 for c in backend.calls if c[0] == "encode") == 4 and batcher.active == 0
    assert all(c[1] == sorted(c[1]) for c in backend.calls if c[0] == "decode")  # rows in slot order


def test_more_sequences_than_slots_reuse_the_freed_ones():
    """Six sequences through two slots (two threads, each taking the next prompt when its
    sequence ends): every one right, only slots 0 and 1 used, both free at the end."""
    backend = ToyBackend(2)
    batcher = StepBatcher(2, backend.encode, backend.decode)
    todo, lock, slots = list(range(len(PROMPTS))), threading.Lock(), []
    got = [None] * len(PROMPTS)
    ready = threading.Barrier(2)  # the first two arrive together

    def drive(_):
        first = True
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            got[i] = greedy(batcher, *PROMPTS[i], slots=slots, ready=ready if first else None)
            first = False

    run_threads(drive, 2)
    assert got == [alone(*p) for p in PROMPTS]
    assert set(slots) == {0, 1} and len(slots) == len(PROMPTS) and batcher.active == 0
    assert max(batcher.decode_batches) == 2


def test_a_failed_call_reaches_every_sequence_in_it_and_frees_their_slots():
    backend = ToyBackend(3)
    batcher = StepBatcher(3, backend.encode, backend.decode)
    backend.fail_on = 5  # three context encodings, one 3-row token generation, then the second fails
    ready = threading.Barrier(3)
    got = run_threads(lambda i: greedy(batcher, [i + 1, 2], 6, ready=ready), 3)
    assert all(isinstance(e, RuntimeError) and "call 5" in str(e) for e in got), got
    assert batcher.decode_batches == [3, 3] and batcher.active == 0
    backend.fail_on = None
    assert greedy(batcher, [1, 2], 3) == alone([1, 2], 3)  # the batcher still serves


def test_a_failed_context_encoding_frees_its_slot():
    backend = ToyBackend(1)
    batcher = StepBatcher(1, backend.encode, backend.decode)
    backend.fail_on = 1
    with pytest.raises(RuntimeError, match="call 1"):
        batcher.start([3, 4])
    assert batcher.active == 0
    assert greedy(batcher, [3, 4], 2) == alone([3, 4], 2)


def test_a_start_waits_for_a_free_slot():
    """With every slot held, a third sequence waits until one ends, and then gets that slot."""
    backend = ToyBackend(2)
    batcher = StepBatcher(2, backend.encode, backend.decode)
    a, _ = batcher.start([1])
    b, _ = batcher.start([2])
    third = {}
    t = threading.Thread(target=lambda: third.update(state=batcher.start([3])[0]))
    t.start()
    t.join(0.3)
    assert t.is_alive() and batcher.active == 2
    batcher.finish(a)
    t.join(WAIT_S)
    assert third["state"] == (a[0], 1)
    batcher.finish(b)
    batcher.finish(third["state"])
    assert batcher.active == 0


def test_a_batch_size_below_one_is_refused():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        StepBatcher(0, lambda s, i: None, lambda r: None)


class BatchedEngine(Engine):
    """An engine on :class:`StepBatcher` over :class:`ToyBackend`, as the neuron engine is built
    on NxDI: ``max_batch_size`` sequences at once; its logits put all mass on word tokens."""

    def __init__(self, tokenizer, max_batch_size: int, *, together: int = 1):
        from g4.convert.embedded_model import EMBEDDED_DIR

        super().__init__(EMBEDDED_DIR, tokenizer, "toy batched engine")
        words = tokenizer.encode(" the cat sat on a mat and ran far away", add_special_tokens=False)
        self.backend = ToyBackend(max_batch_size, vocab=sorted(set(words)))
        self.max_batch_size = max_batch_size
        self.batcher = StepBatcher(max_batch_size, self.backend.encode, self.backend.decode)
        # the first ``together`` requests each hold their slot before any of them decodes (else a
        # toy sequence can end before the next thread has woken up, and nothing would be batched;
        # a barrier before the context encodings is not enough on a loaded machine)
        self._arrive, self._early, self._lock = threading.Barrier(together), together, threading.Lock()

    def start(self, prompt_ids):
        with self._lock:
            early, self._early = self._early > 0, self._early - 1
        started = self.batcher.start(list(prompt_ids))
        if early:
            self._arrive.wait(WAIT_S)
        return started

    def step(self, state, token):
        return self.batcher.step(state, token)

    def finish(self, state):
        self.batcher.finish(state)


@pytest.fixture(scope="module")
def tokenizer():
    return cpu_engine("nvfp4").tokenizer


def test_generate_steps_frees_the_slot_when_closed_early(tokenizer):
    """A stop string or a client gone closes the generator mid-sequence: its slot is freed."""
    engine = BatchedEngine(tokenizer, 2)
    steps = engine.generate_steps([2, 10, 11], SamplingParams(max_tokens=20, temperature=0.0))
    next(steps)
    next(steps)
    assert engine.batcher.active == 1
    steps.close()
    assert engine.batcher.active == 0


def _answers(engine, prompts, max_tokens=7) -> tuple[list[str], GenerationWorker]:
    worker = GenerationWorker(engine)

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [_Job(p, SamplingParams(max_tokens=max_tokens, temperature=0.0), [], loop, asyncio.Queue())
                for p in prompts]
        for job in jobs:
            worker.submit(job)
        out = []
        for job in jobs:
            text = ""
            while True:
                kind, payload = await asyncio.wait_for(job.events.get(), WAIT_S)
                if kind == "delta":
                    text += payload[1].content
                elif kind == "done":
                    break
                else:
                    raise AssertionError(payload)
            out.append(text)
        return out

    try:
        return asyncio.run(go()), worker
    finally:
        worker.stop()


def test_the_server_worker_runs_max_batch_size_requests_at_once(tokenizer):
    """GenerationWorker with a batched engine: B threads, queued requests generated B at a time
    with their token generation in shared calls, each answer what it is when run alone."""
    prompts = [[2, 10 + i, 20 + 2 * i] for i in range(5)]
    one, one_worker = _answers(BatchedEngine(tokenizer, 1), prompts)
    engine = BatchedEngine(tokenizer, 3, together=3)
    three, worker = _answers(engine, prompts)
    assert len(one_worker.threads) == 1 and len(worker.threads) == 3
    assert three == one and all(one)
    assert engine.batcher.decode_batches[0] == 3 and engine.batcher.active == 0
    assert len(engine.batcher.decode_batches) < len(one_worker.engine.batcher.decode_batches)
