"""The generation worker: every submitted job ends with one "done" or "error" event, whatever
happened to the request that submitted it or to the jobs before it; no request waits forever.

These drive :class:`GenerationWorker` directly with their own event loops and a bounded wait,
so a regression fails here in seconds instead of hanging an HTTP test.
"""

import asyncio
import threading

import pytest
from serve_fixtures import ScriptedEngine, cpu_engine

from g4.serve.engine import SamplingParams
from g4.serve.server import APIError, GenerationWorker, _Job

WAIT_S = 30


@pytest.fixture(scope="module")
def tokenizer():
    return cpu_engine("nvfp4").tokenizer


class GatedEngine(ScriptedEngine):
    """Scripted; ``start`` waits for ``gate`` and raises ``fail`` (an exception instance) if set."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail: BaseException | None = None

    def start(self, prompt_ids):
        self.started.set()
        assert self.gate.wait(WAIT_S)
        if self.fail is not None:
            raise self.fail
        return super().start(prompt_ids)


@pytest.fixture
def engine(tokenizer):
    return GatedEngine(tokenizer, tokenizer.encode("Paris", add_special_tokens=False) + [106])


def new_job(loop, max_tokens=8) -> _Job:
    return _Job([2, 3], SamplingParams(max_tokens=max_tokens), [], loop, asyncio.Queue())


async def finish(job: _Job) -> tuple[str, object, str]:
    """Wait (bounded) for the job's last event; return (kind, payload, content)."""
    content = ""
    while True:
        kind, payload = await asyncio.wait_for(job.events.get(), WAIT_S)
        if kind == "delta":
            content += payload[1].content  # (index, Delta, ids, logprobs)
        else:
            return kind, payload, content


def run_one(worker: GenerationWorker) -> tuple[str, object, str]:
    async def go():
        job = new_job(asyncio.get_running_loop())
        worker.submit(job)
        return await finish(job)

    return asyncio.run(go())


def test_a_job_whose_request_loop_has_closed_does_not_stop_the_worker(engine):
    """A client that left (TestClient closes its loop; a stopped uvicorn does too) while its job
    was generating: emitting to the closed loop used to kill the worker thread, and the next
    request then waited forever."""
    worker = GenerationWorker(engine)
    engine.gate.clear()
    gone = asyncio.new_event_loop()
    job = new_job(gone)
    worker.submit(job)
    assert engine.started.wait(WAIT_S)
    gone.close()  # the request ended while the job is generating
    engine.gate.set()
    kind, payload, content = run_one(worker)
    assert (kind, content) == ("done", "Paris") and payload["finish_reason"] == "stop"
    assert job.cancelled.is_set() and worker.alive and worker.thread.is_alive()
    worker.close()


def test_a_failing_generation_is_an_error_for_that_request_only(engine):
    worker = GenerationWorker(engine)
    engine.fail = ValueError("boom")
    kind, err, _ = run_one(worker)
    assert kind == "error" and isinstance(err, APIError) and err.status == 500
    assert err.message == "generation failed: ValueError: boom"
    engine.fail = None
    assert run_one(worker)[::2] == ("done", "Paris")
    worker.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit, on purpose
def test_jobs_queued_when_the_thread_ends_get_an_error_and_later_submits_a_503(engine):
    """The thread ends in the middle of a job (SystemExit is not caught by the worker): that job
    and the ones queued behind it are answered, not left waiting."""
    worker = GenerationWorker(engine)
    engine.gate.clear()
    engine.fail = SystemExit()

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [new_job(loop) for _ in range(3)]
        for j in jobs:
            worker.submit(j)
        assert await asyncio.to_thread(engine.started.wait, WAIT_S)
        engine.gate.set()
        return [await finish(j) for j in jobs]

    for kind, err, content in asyncio.run(go()):
        assert (kind, content) == ("error", "") and (err.status, err.code) == (503, "worker_stopped")
    worker.thread.join(WAIT_S)
    assert not worker.alive
    with pytest.raises(APIError) as e:
        worker.submit(new_job(asyncio.new_event_loop()))
    assert (e.value.status, e.value.code) == (503, "worker_stopped")


def test_close_finishes_the_queued_jobs_then_refuses(engine):
    worker = GenerationWorker(engine)
    engine.gate.clear()

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [new_job(loop) for _ in range(3)]
        for j in jobs:
            worker.submit(j)
        worker.close()
        with pytest.raises(APIError):
            worker.submit(new_job(loop))
        engine.gate.set()
        return [await finish(j) for j in jobs]

    assert [(k, c) for k, _, c in asyncio.run(go())] == [("done", "Paris")] * 3
    worker.thread.join(WAIT_S)
    assert not worker.thread.is_alive()
    worker.close()  # a second close is a no-op


def test_a_full_queue_answers_503_server_busy(engine):
    worker = GenerationWorker(engine, max_queue=2)
    engine.gate.clear()
    loop = asyncio.new_event_loop()
    worker.submit(new_job(loop))
    assert engine.started.wait(WAIT_S)  # the first job is running, off the queue
    worker.submit(new_job(loop))
    worker.submit(new_job(loop))
    with pytest.raises(APIError) as e:
        worker.submit(new_job(loop))
    assert (e.value.status, e.value.code) == (503, "server_busy")
    engine.gate.set()
    worker.close()
    worker.thread.join(WAIT_S)
    loop.close()


class SlowEngine(ScriptedEngine):
    """Scripted, 200 tokens long; ``step`` counts, and waits on ``gate`` at step 5."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, tokenizer.encode(" word" * 200, add_special_tokens=False))
        self.steps = 0
        self.at_gate = threading.Event()
        self.gate = threading.Event()

    def step(self, state, token):
        self.steps += 1
        if self.steps == 5:
            self.at_gate.set()
            assert self.gate.wait(WAIT_S)
        return super().step(state, token)


def test_stop_cancels_the_running_job_and_answers_the_queued_ones(tokenizer):
    engine = SlowEngine(tokenizer)
    worker = GenerationWorker(engine)

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [new_job(loop, max_tokens=200) for _ in range(3)]
        for j in jobs:
            worker.submit(j)
        assert await asyncio.to_thread(engine.at_gate.wait, WAIT_S)
        stopping = asyncio.create_task(asyncio.to_thread(worker.stop, WAIT_S))
        await asyncio.sleep(0.05)
        engine.gate.set()
        assert await stopping  # the thread ended
        return [await finish(j) for j in jobs]

    for kind, err, _ in asyncio.run(go()):
        assert kind == "error" and (err.status, err.code) == (503, "worker_stopped")
    assert engine.steps < 10  # the running job stopped at its next token, the queued ones never ran
    assert not worker.alive


def test_jobs_whose_clients_left_do_not_hold_queue_slots(engine):
    worker = GenerationWorker(engine, max_queue=2)
    engine.gate.clear()
    loop = asyncio.new_event_loop()
    worker.submit(new_job(loop))
    assert engine.started.wait(WAIT_S)
    left = [new_job(loop), new_job(loop)]
    for j in left:
        worker.submit(j)
    for j in left:
        j.cancelled.set()  # their clients disconnected while queued
    assert worker.waiting == 0
    worker.submit(new_job(loop))  # accepted: the two cancelled jobs gave their slots back
    assert worker.waiting == 1
    engine.gate.set()
    worker.close()
    worker.thread.join(WAIT_S)
    assert not worker.thread.is_alive()
    loop.close()
