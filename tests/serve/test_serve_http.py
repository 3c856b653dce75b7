"""The OpenAI-compatible HTTP front on the embedded model: validation errors, streaming,
reasoning over SSE, concurrency, and both converted formats answering through real sockets."""

import json
import threading
import time

import openai
import pytest
from fastapi.testclient import TestClient
from serve_fixtures import ScriptedEngine, cpu_app, cpu_engine, embedded_result

from g4.serve.chat import control_text_in, render_prompt
from g4.serve.server import BackgroundServer, create_app

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "tiny-nvfp4"


@pytest.fixture(scope="module")
def client():
    return TestClient(cpu_app("nvfp4"))


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "temperature": 0} | body)


def sse(response) -> list[dict | str]:
    """The ``data:`` payloads of an SSE body (``[DONE]`` as a string)."""
    out = []
    for line in response.text.split("\n\n"):
        if line.strip():
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed(client, **body) -> tuple[str, str, str, list[dict]]:
    r = chat(client, stream=True, **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1
    return content, reasoning, finish[0], chunks


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL] and data[0]["owned_by"] == "g4-cpu"


def test_paris_and_usage(client):
    r = chat(client, return_token_ids=True)
    assert r.status_code == 200
    body = r.json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Paris" and choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] is None
    ids = choice["token_ids"]
    assert ids[-1] == 106  # stopped at <turn|>, taken from generation_config.json
    engine = cpu_engine("nvfp4")
    prompt_len = len(engine.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"])
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(ids),
                             "total_tokens": prompt_len + len(ids)}


@pytest.mark.parametrize("messages", [
    FRANCE,
    [{"role": "user", "content": "Once upon a time there was"}],
    [{"role": "system", "content": "You are a helpful assistant. Answer in one word."},
     {"role": "user", "content": "Who wrote Hamlet?"}],
])
@pytest.mark.parametrize("max_tokens", [1, 12])
def test_streaming_equals_non_streaming(client, messages, max_tokens):
    r = chat(client, messages=messages, max_tokens=max_tokens).json()
    content, reasoning, finish, chunks = streamed(client, messages=messages, max_tokens=max_tokens,
                                                  stream_options={"include_usage": True})
    assert content == r["choices"][0]["message"]["content"]
    assert finish == r["choices"][0]["finish_reason"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"] == r["usage"] and chunks[-1]["choices"] == []
    if max_tokens == 1:
        assert finish == "length" and r["usage"]["completion_tokens"] == 1
    assert not control_text_in(content)


def test_stream_options_include_usage_puts_null_usage_on_every_chunk_but_the_last(client):
    """OpenAI's contract (P16): strict clients read ``usage`` on every chunk."""
    _, _, _, chunks = streamed(client, stream_options={"include_usage": True})
    *text, last = chunks
    assert text and all("usage" in c and c["usage"] is None for c in text)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    _, _, _, chunks = streamed(client)  # not asked: no usage anywhere
    assert all("usage" not in c for c in chunks)


def test_token_ids_only_when_asked_and_streamed_per_chunk(client):
    plain = chat(client).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    asked = chat(client, return_token_ids=True).json()
    ids = asked["choices"][0]["token_ids"]
    assert asked["prompt_token_ids"] == render_prompt(cpu_engine("nvfp4").tokenizer, FRANCE)
    assert ids[-1] == 106 and len(ids) == asked["usage"]["completion_tokens"]
    _, _, _, chunks = streamed(client, return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == asked["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == ids
    assert all("token_ids" not in c["choices"][0] for c in streamed(client)[3])


def test_stop_string_and_seeded_sampling(client):
    r = chat(client, stop=["ri"]).json()["choices"][0]
    assert (r["message"]["content"], r["finish_reason"]) == ("Pa", "stop")
    content, _, finish, _ = streamed(client, stop="ri")
    assert (content, finish) == ("Pa", "stop")
    a = chat(client, temperature=1.5, seed=7, max_tokens=8, return_token_ids=True).json()["choices"][0]["token_ids"]
    b = chat(client, temperature=1.5, seed=7, max_tokens=8, return_token_ids=True).json()["choices"][0]["token_ids"]
    assert a == b


BAD_REQUESTS = [
    ("{not json", 400, None, "invalid_json"),
    ("[1, 2]", 400, None, None),
    ({"messages": []}, 400, "messages", None),
    ({}, 400, "messages", None),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", None),
    ({"messages": [{"role": "user"}]}, 400, "messages.0", None),
    ({"messages": FRANCE, "seed": 1 << 70}, 400, "seed", None),
    ({"messages": FRANCE, "temperature": -0.1}, 400, "temperature", None),
    ({"messages": FRANCE, "temperature": "hot"}, 400, "temperature", None),
    ({"messages": FRANCE, "top_p": 0}, 400, "top_p", None),
    ({"messages": FRANCE, "top_p": 1.5}, 400, "top_p", None),
    ({"messages": FRANCE, "max_tokens": 0}, 400, "max_tokens", None),
    ({"messages": FRANCE, "max_tokens": 4096}, 400, "max_tokens", "context_length_exceeded"),
    ({"messages": FRANCE, "max_completion_tokens": 2040}, 400, "max_tokens", "context_length_exceeded"),
    ({"messages": FRANCE, "n": 17}, 400, "n", None),
    ({"messages": FRANCE, "n": 0}, 400, "n", None),
    ({"messages": FRANCE, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages", None),
    ({"messages": FRANCE, "chat_template_kwargs": {"tokenize": False}}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": "x " * 3000}]}, 400, "messages", "context_length_exceeded"),
    # strict JSON types: no silent coercion
    ({"messages": FRANCE, "max_tokens": "12"}, 400, "max_tokens", None),
    ({"messages": FRANCE, "max_tokens": 12.5}, 400, "max_tokens", None),
    ({"messages": FRANCE, "stream": "yes"}, 400, "stream", None),
    ({"messages": FRANCE, "chat_template_kwargs": {"enable_thinking": "no"}}, 400, "chat_template_kwargs", None),
    # features this server does not have are refused, not ignored
    ({"messages": FRANCE, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ({"messages": FRANCE, "logprobs": "yes"}, 400, "logprobs", None),
    ({"messages": FRANCE, "tools": [{"type": "retrieval"}]}, 400, "tools", None),  # function tools only
    ({"messages": FRANCE, "response_format": {"type": "grammar"}}, 400, "response_format", None),
    ({"messages": FRANCE, "logit_bias": {"520": -100}}, 400, "logit_bias", None),
    ({"messages": FRANCE, "presence_penalty": 0.5}, 400, "presence_penalty", None),
    ({"messages": FRANCE, "frequency_penalty": "x"}, 400, "frequency_penalty", None),
    ({"messages": FRANCE, "functions": [{"name": "f"}]}, 400, "functions", None),
    ({"messages": FRANCE, "tool_choice": "required"}, 400, "tool_choice", None),
    ({"messages": FRANCE, "min_tokens": 5}, 400, "min_tokens", None),
    ({"messages": FRANCE, "ignore_eos": True}, 400, "ignore_eos", None),
    ({"messages": FRANCE, "best_of": 2}, 400, "best_of", None),
    ({"messages": FRANCE, "echo": True}, 400, "echo", None),
    ({"messages": FRANCE, "top_logprobs": 3}, 400, "top_logprobs", None),
    ({"messages": FRANCE, "logprobs": False, "top_logprobs": 3}, 400, "top_logprobs", None),
    # fields this server does not know are refused, as OpenAI's API does (vLLM's, OpenAI's newer ones)
    ({"messages": FRANCE, "bad_words": ["Paris"]}, 400, "bad_words", None),
    ({"messages": FRANCE, "guided_json": {"type": "object"}}, 400, "guided_json", None),
    ({"messages": FRANCE, "add_generation_prompt": False}, 400, "add_generation_prompt", None),
    ({"messages": FRANCE, "reasoning_effort": "low"}, 400, "reasoning_effort", None),
    ("[" * 100_000 + "]" * 100_000, 400, None, "invalid_json"),
    # stream_options (P16): only with streaming, only the keys it has; vLLM's continuous usage is not served
    ({"messages": FRANCE, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ({"messages": FRANCE, "stream": False, "stream_options": {}}, 400, "stream_options", None),
    ({"messages": FRANCE, "stream": True, "stream_options": {"include_usage": True, "chunk_size": 4}}, 400,
     "stream_options.chunk_size", None),
    ({"messages": FRANCE, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats", None),
    ({"messages": FRANCE, "stream": True, "stream_options": {"include_obfuscation": True}}, 400,
     "stream_options.include_obfuscation", None),
    ({"messages": FRANCE, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", None),
    ({"messages": FRANCE, "return_token_ids": "yes"}, 400, "return_token_ids", None),
]


@pytest.mark.parametrize("body, status, param, code", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, body, status, param, code):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code) if code else err["param"] == param
    assert chat(client).json()["choices"][0]["message"]["content"] == "Paris"


def test_the_refusable_fields_at_their_harmless_values_are_accepted(client):
    r = chat(client, logprobs=False, tools=[], response_format={"type": "text"}, temperature=0, max_tokens=8,
             chat_template_kwargs={"enable_thinking": False}, tool_choice="auto", logit_bias={}, presence_penalty=0,
             frequency_penalty=0.0, best_of=1, echo=False, user="u1", metadata={"k": "v"}, store=False,
             return_token_ids=False, stream_options=None)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Paris"
    # stream_options' refusable keys at their no-op value (current OpenAI SDKs may send include_obfuscation)
    r = chat(client, stream=True, stream_options={"include_obfuscation": False, "continuous_usage_stats": False})
    assert r.status_code == 200 and '"Paris"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    # null is "not given", as the OpenAI API has it
    r = chat(client, stream=None, n=None, max_tokens=None, seed=None, stop=None, top_p=None,
             chat_template_kwargs={"enable_thinking": None})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Paris"


def test_oversize_bodies_are_refused_before_parsing(client):
    big = b'{"messages": [' + b" " * (1 << 20) + b"]}"
    r = client.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # chunked, without Content-Length: counted while reading
    r = client.post("/v1/chat/completions", content=iter([b"{" + b" " * 65536] * 20),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.get("/nope").json()["error"]["code"] == "not_found"
    assert chat(client).json()["choices"][0]["message"]["content"] == "Paris"


@pytest.fixture(scope="module")
def scripted():
    """A server whose engine emits a thought block, then an answer with multi-byte text."""
    tok = cpu_engine("nvfp4").tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    script = [100] + enc("thought\nFrance → capital is Paris") + [101] + enc("Paris, 巴黎") + [106]
    engine = ScriptedEngine(tok, script)
    return TestClient(create_app(engine, served_model_name=MODEL)), script


def test_reasoning_is_separated_streamed_and_not(scripted):
    client, script = scripted
    r = chat(client, return_token_ids=True).json()["choices"][0]
    assert r["message"]["reasoning_content"] == "France → capital is Paris"
    assert r["message"]["content"] == "Paris, 巴黎"
    assert r["token_ids"] == script and r["finish_reason"] == "stop"
    content, reasoning, finish, chunks = streamed(client)
    assert (content, reasoning, finish) == ("Paris, 巴黎", "France → capital is Paris", "stop")
    assert all("\ufffd" not in json.dumps(c, ensure_ascii=False) for c in chunks)
    # cut inside the thought block: reasoning only, finish_reason length
    r = chat(client, max_tokens=8).json()["choices"][0]
    assert r["message"]["content"] == "" and r["message"]["reasoning_content"] and r["finish_reason"] == "length"
    assert streamed(client, max_tokens=8)[:3] == ("", r["message"]["reasoning_content"], "length")


# each generation endpoint with a body that asks for a reply
ENDPOINTS = [("/v1/chat/completions", {"messages": FRANCE}), ("/v1/completions", {"prompt": "France"})]


@pytest.mark.parametrize("path, prompt", ENDPOINTS)
def test_a_client_that_leaves_mid_stream_does_not_block_the_next(scripted, path, prompt):
    client, _ = scripted
    with client.stream("POST", path, json=prompt | {"stream": True, "temperature": 0}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    assert chat(client).json()["choices"][0]["message"]["content"] == "Paris, 巴黎"
    assert client.app.state.worker.alive  # the left job's late events did not end the worker


@pytest.mark.parametrize("kind", ["nvfp4", "int8-neuron"])
def test_both_formats_answer_paris_over_a_real_socket(kind):
    """Real uvicorn on a loopback port, the openai client, four concurrent clients."""
    with BackgroundServer(cpu_app(kind)) as srv:
        assert srv.host == "127.0.0.1"
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = c.chat.completions.create(model=f"tiny-{kind}", messages=FRANCE, temperature=0, max_tokens=8)
        assert r.choices[0].message.content == "Paris"
        stream = c.chat.completions.create(model=f"tiny-{kind}", messages=FRANCE, temperature=0, max_tokens=8,
                                           stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == "Paris"

        questions = [("What is the capital of Japan?", "Tokyo"), ("Who wrote Hamlet?", "Shakespeare"),
                     ("What is 2+2?", "4"), ("What is the capital of Spain?", "Madrid")]
        answers = {}

        def ask(q):
            r = c.chat.completions.create(model=f"tiny-{kind}", messages=[{"role": "user", "content": q}],
                                          temperature=0, max_tokens=8)
            answers[q] = r.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(q,)) for q, _ in questions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert answers == dict(questions)
    assert embedded_result(kind).is_dir()


def test_chat_template_kwargs_reach_the_template():
    """enable_thinking renders the checkpoint's template differently (a template in the style of
    the 26B release), and with thinking off the reply after the closed empty block is content."""
    from transformers import AutoTokenizer
    from test_serve_chat import THINKING_TEMPLATE

    from g4.convert.embedded_model import EMBEDDED_DIR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    tok.chat_template = THINKING_TEMPLATE
    script = [100] + tok.encode("thought\nadd", add_special_tokens=False) + [101] + tok.encode(
        "4", add_special_tokens=False) + [106]
    client = TestClient(create_app(ScriptedEngine(tok, script), served_model_name=MODEL))
    on = chat(client, chat_template_kwargs={"enable_thinking": True}).json()
    off = chat(client, chat_template_kwargs={"enable_thinking": False}).json()
    from g4.serve.chat import render_prompt

    for r, thinking in ((on, True), (off, False)):
        assert r["usage"]["prompt_tokens"] == len(render_prompt(tok, FRANCE, {"enable_thinking": thinking}))
    assert on["usage"]["prompt_tokens"] != off["usage"]["prompt_tokens"]
    for r in (on, off):
        assert (r["choices"][0]["message"]["content"], r["choices"][0]["message"]["reasoning_content"]) == ("4", "add")


def test_an_app_serves_again_after_a_uvicorn_run_and_a_stopped_worker_answers_503():
    tok = cpu_engine("nvfp4").tokenizer
    app = create_app(ScriptedEngine(tok, tok.encode("Paris", add_special_tokens=False) + [106]),
                     served_model_name=MODEL)
    for _ in range(2):
        with BackgroundServer(app) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
            assert c.chat.completions.create(model=MODEL, messages=FRANCE).choices[0].message.content == "Paris"
    assert chat(TestClient(app)).json()["choices"][0]["message"]["content"] == "Paris"
    app.state.worker.close()
    app.state.worker.thread.join(10)
    r = chat(TestClient(app))
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_stopped"


@pytest.mark.parametrize("path, prompt", ENDPOINTS)
def test_a_non_streaming_client_that_leaves_cancels_its_generation(path, prompt):
    """Over a real socket: the client sends a non-streaming request and closes the connection
    while its reply is generating; the job stops instead of running to max_tokens."""
    import socket

    from test_serve_worker import WAIT_S, SlowEngine

    engine = SlowEngine(cpu_engine("nvfp4").tokenizer)
    app = create_app(engine, served_model_name=MODEL)
    worker = app.state.worker
    body = json.dumps(prompt | {"max_tokens": 200}).encode()
    with BackgroundServer(app) as srv:
        with socket.create_connection((srv.host, srv.port)) as s:
            s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
            assert engine.at_gate.wait(WAIT_S)
        job, = worker.running
        deadline = time.monotonic() + WAIT_S
        while not job.cancelled.is_set():  # the server noticed the disconnect
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.gate.set()
        while worker.running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.steps < 10
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        r = c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=3)
        assert r.choices[0].message.content == " word word word"
    worker.stop()


def test_a_non_streaming_client_that_leaves_while_queued_ends_its_request():
    """Its job is skipped, and its request handler ends too (it used to wait forever for events
    of a job that never ran: a task and its memory per such client, until shutdown)."""
    import socket

    from test_serve_worker import WAIT_S, SlowEngine

    engine = SlowEngine(cpu_engine("nvfp4").tokenizer)
    app = create_app(engine, served_model_name=MODEL)
    worker = app.state.worker
    body = json.dumps({"messages": FRANCE, "max_tokens": 200}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with BackgroundServer(app) as srv:
        running = socket.create_connection((srv.host, srv.port))
        running.sendall(request)
        assert engine.at_gate.wait(WAIT_S)  # the first request is generating
        for _ in range(5):  # five more queue behind it, then leave
            with socket.create_connection((srv.host, srv.port)) as s:
                s.sendall(request)
                deadline = time.monotonic() + WAIT_S
                while worker.waiting == 0:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
        tasks = srv.server.server_state.tasks  # uvicorn's open request tasks
        deadline = time.monotonic() + WAIT_S
        while worker.waiting or len(tasks) > 1:  # only the running request is left
            assert time.monotonic() < deadline, (worker.waiting, len(tasks))
            time.sleep(0.01)
        running.close()
        engine.gate.set()
    worker.stop()


def scrape(url: str, model: str = MODEL) -> dict[str, float]:
    """``GET url/metrics`` parsed by prometheus_client: {sample name: value} of g4serve's samples
    (each checked to carry the label model_name=``model``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:  # raises on a non-200
        assert r.headers["content-type"].startswith("text/plain"), r.headers
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("g4serve:"):
                assert sample.labels == {"model_name": model}, sample
                out[sample.name] = sample.value
    return out


def test_metrics_count_the_running_waiting_and_received_requests():
    """``/metrics`` while one request generates and two wait behind it (a refused request is not
    counted), then once all three are answered; the numbers as a Prometheus scraper reads them."""
    from test_serve_worker import WAIT_S, SlowEngine

    engine = SlowEngine(cpu_engine("nvfp4").tokenizer)
    app = create_app(engine, served_model_name=MODEL)
    with BackgroundServer(app) as srv:
        assert scrape(srv.url) == {"g4serve:num_requests_running": 0, "g4serve:num_requests_waiting": 0,
                                   "g4serve:request_received_total": 0}
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=0)
        answers = []
        asks = [threading.Thread(target=lambda: answers.append(
            c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8).choices[0].finish_reason))
            for _ in range(3)]
        for t in asks:
            t.start()
        assert engine.at_gate.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while (now := scrape(srv.url))["g4serve:num_requests_waiting"] < 2:
            assert time.monotonic() < deadline, now
            time.sleep(0.01)
        assert now == {"g4serve:num_requests_running": 1, "g4serve:num_requests_waiting": 2,
                       "g4serve:request_received_total": 3}
        engine.gate.set()
        for t in asks:
            t.join(WAIT_S)
        assert answers == ["length"] * 3
        assert scrape(srv.url) == {"g4serve:num_requests_running": 0, "g4serve:num_requests_waiting": 0,
                                   "g4serve:request_received_total": 3}
    app.state.worker.stop()


@pytest.mark.parametrize("signals, drain_s", [(["SIGTERM"], 0), (["SIGINT", "SIGINT"], 5)])
def test_shutdown_is_bounded_with_a_stalled_client_and_a_generation_in_flight(signals, drain_s):
    """`g4serve` as a process: one client sent half a body and stalls, 60 others are generating or
    queued. SIGTERM drains for --shutdown-timeout (0 here), then answers what is left with an
    OpenAI-style 503; a second Ctrl-C cuts short at once. Either way: "stopped", exit code 0,
    no abort from a torch kernel at exit, no traceback per cancelled request in the log."""
    import signal
    import socket

    from serve_fixtures import start_g4serve

    from g4.convert.embedded_model import EMBEDDED_DIR

    proc, port = start_g4serve(str(EMBEDDED_DIR), "--served-model-name", "tiny", "--shutdown-timeout", str(drain_s))
    try:
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 46\r\n\r\n{\"messages\"")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        outcome = []

        def ask(q):
            try:
                c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=64)
                outcome.append("answered")
            except openai.APIStatusError as e:
                outcome.append((e.status_code, (e.body or {}).get("code") if isinstance(e.body, dict) else e.body))
            except openai.OpenAIError as e:
                outcome.append(type(e).__name__)

        questions = ["What is the capital of France?", "Who wrote Hamlet?", "Once upon a time there was"] * 20
        threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        # every request has reached the worker (one is generating, the rest queued or answered):
        # signalled earlier, a request still connecting is refused or its unread bytes are cut
        # with the idle connection, which is uvicorn's shutdown, not the drain this tests
        while scrape(f"http://127.0.0.1:{port}", "tiny").get("g4serve:request_received_total", 0) < len(questions):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        for name in signals:
            proc.send_signal(getattr(signal, name))
            time.sleep(0.3)
        out = proc.communicate(timeout=60)[0]
        took = time.monotonic() - start
        for t in threads:
            t.join(30)
        stalled.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out.rstrip().endswith("stopped"), out
    assert "terminate called" not in out and took < 20, (took, out)
    # every client got an end (an answer, an error or a closed connection)
    assert not any(t.is_alive() for t in threads) and len(outcome) == len(questions)
    assert "Traceback" not in out, out
    if signals == ["SIGTERM"]:  # an orderly end: an answer, or a 503 worker_stopped, never a cut connection
        assert set(outcome) <= {"answered", (503, "worker_stopped")} and (503, "worker_stopped") in outcome, outcome


def test_a_client_that_leaves_mid_body_is_not_logged_as_a_server_error(caplog):
    import logging
    import socket

    with caplog.at_level(logging.WARNING), BackgroundServer(cpu_app("nvfp4")) as srv:
        for _ in range(3):
            with socket.create_connection((srv.host, srv.port)) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess")
        time.sleep(0.3)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8).choices[0].message.content == \
            "Paris"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# ---- /v1/completions: the same engine, worker, limits and checks; a prompt in, text out ----

def complete(client, **body):
    return client.post("/v1/completions", json={"model": MODEL, "temperature": 0} | body)


def france_ids() -> list[int]:
    return render_prompt(cpu_engine("nvfp4").tokenizer, FRANCE)


@pytest.mark.parametrize("messages, max_tokens", [(FRANCE, 8), ([{"role": "user", "content": "Once upon a time"}], 12)])
def test_completions_text_is_what_the_chat_path_generates_for_the_same_ids(client, messages, max_tokens):
    """No chat template: the rendered chat prompt's ids as the prompt give the chat reply's ids."""
    tok = cpu_engine("nvfp4").tokenizer
    c = chat(client, messages=messages, max_tokens=max_tokens, return_token_ids=True).json()
    ids = c["choices"][0]["token_ids"]
    r = complete(client, prompt=c["prompt_token_ids"], max_tokens=max_tokens, return_token_ids=True).json()
    choice = r["choices"][0]
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == MODEL
    assert choice["token_ids"] == ids and choice["prompt_token_ids"] == c["prompt_token_ids"]
    assert choice["text"] == tok.decode(ids, skip_special_tokens=True)
    assert (choice["finish_reason"], choice["logprobs"], choice["index"]) == (c["choices"][0]["finish_reason"], None, 0)
    assert r["usage"] == c["usage"]
    # a list of one prompt is that prompt
    assert complete(client, prompt=[c["prompt_token_ids"]], max_tokens=max_tokens).json()["choices"][0]["text"] \
        == choice["text"]


def test_completions_string_prompt_stop_strings_and_plain_text(client, scripted):
    tok = cpu_engine("nvfp4").tokenizer
    prompt = tok.decode(france_ids()[1:])  # the rendered chat as text: tokenized again with <bos>
    r = complete(client, prompt=prompt, max_tokens=8).json()
    assert r["choices"][0]["text"] == "Paris" and r["usage"]["prompt_tokens"] == len(france_ids())
    assert complete(client, prompt=[prompt], max_tokens=8).json()["choices"][0]["text"] == "Paris"
    r = complete(client, prompt=france_ids(), stop="ri").json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == ("Pa", "stop")
    # a reply with a thought block is plain text: control tokens dropped, no reasoning split
    sclient, script = scripted
    r = sclient.post("/v1/completions", json={"prompt": "x", "temperature": 0}).json()["choices"][0]
    assert r["text"] == tok.decode(script, skip_special_tokens=True)
    assert r["text"] == "thought\nFrance → capital is ParisParis, 巴黎"
    assert "reasoning_content" not in json.dumps(r)


def test_completions_stream_with_the_openai_client_over_a_real_socket():
    with BackgroundServer(cpu_app("nvfp4")) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = c.completions.create(model=MODEL, prompt=france_ids(), temperature=0, max_tokens=8)
        assert (r.object, r.choices[0].text, r.choices[0].finish_reason) == ("text_completion", "Paris", "stop")
        assert r.usage.prompt_tokens == len(france_ids()) and r.usage.completion_tokens == 2
        chunks = list(c.completions.create(model=MODEL, prompt=france_ids(), temperature=0, max_tokens=8,
                                           stream=True, stream_options={"include_usage": True}))
        *text, last = chunks
        assert "".join(ch.choices[0].text for ch in text) == "Paris"
        assert [ch.choices[0].finish_reason for ch in text][-1] == "stop"
        assert all(ch.usage is None for ch in text) and last.choices == [] and last.usage == r.usage
        # the same from the chat endpoint, through the same client
        chunks = list(c.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=8,
                                                stream=True, stream_options={"include_usage": True}))
        assert all(ch.usage is None for ch in chunks[:-1]) and chunks[-1].usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="x", stream_options={"include_usage": True})
        assert e.value.body["param"] == "stream_options"


COMPLETION_BAD_REQUESTS = [
    ({}, "prompt", None),
    ({"prompt": 12}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": [[]]}, "prompt", None),
    ({"prompt": ["a", "b"]}, "prompt", None),
    ({"prompt": [[1, 2], [3]]}, "prompt", None),
    ({"prompt": [2, -1]}, "prompt", None),
    ({"prompt": [2, 1 << 20]}, "prompt", None),
    ({"prompt": [2, 1.5]}, "prompt", None),
    ({"prompt": "x " * 3000}, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 4096}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "x", "n": 17}, "n", None),
    ({"prompt": "x", "echo": True}, "echo", None),
    ({"prompt": "x", "logprobs": 21}, "logprobs", None),
    ({"prompt": "x", "logprobs": -1}, "logprobs", None),
    ({"prompt": "x", "suffix": "end"}, "suffix", None),
    ({"prompt": "x", "best_of": 2}, "best_of", None),
    ({"prompt": "x", "temperature": 3}, "temperature", None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),
    ({"prompt": "x", "stream": True, "stream_options": {"usage": True}}, "stream_options.usage", None),
    ({"prompt": "x", "messages": FRANCE}, "messages", None),
    ({"prompt": "x", "chat_template_kwargs": {}}, "chat_template_kwargs", None),
    ({"prompt": "x", "add_special_tokens": False}, "add_special_tokens", None),
]


@pytest.mark.parametrize("body, param, code", COMPLETION_BAD_REQUESTS)
def test_completions_bad_requests_get_openai_errors(client, body, param, code):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert complete(client, prompt=france_ids(), max_tokens=8).json()["choices"][0]["text"] == "Paris"


def test_completions_no_op_values_are_accepted_and_unknown_models_are_404(client):
    r = complete(client, prompt=france_ids(), echo=False, suffix="", best_of=1, logprobs=None, n=1, user="u",
                 max_tokens=8)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Paris"
    r = complete(client, prompt="x", model="gpt-3.5-turbo-instruct")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
