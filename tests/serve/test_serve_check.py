"""`g4serve check` end to end and the `g4serve` command line."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from tampered import INT8_TAMPERS, NVFP4_TAMPERS, RANK1, assert_one_error_line, tampered_copy
from serve_fixtures import cpu_app, embedded_result, start_g4serve

from g4.convert.embedded_model import EMBEDDED_DIR, load_facts
from g4.convert.verify import DEFAULT_PROMPTS
from g4.core.errors import CheckpointError
from g4.serve.check import STOP, agreement, free_port, load_tool_cases, normalise_ids
from helpers import g4convert, g4serve
from g4.serve.server import BackgroundServer

REPORT_KEYS = {"g4_verification", "format", "backend", "engine", "source", "min_agreement", "passed", "failures", "overall",
               "prompts", "facts", "tool_calls", "chat_checks"}


run = g4serve


def report_bytes(out):
    """OUT/verification.json as it is (None when absent), to show a refused check left it alone."""
    path = out / "verification.json"
    return path.read_bytes() if path.exists() else None


@pytest.fixture(scope="module")
def nvfp4_copy(tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "gemma4-tiny-nvfp4"
    shutil.copytree(embedded_result("nvfp4"), out)
    return out


def test_help_lists_both_usages():
    r = run("--help")
    assert r.exit_code == 0
    assert "g4serve OUT [--backend auto|cpu|vllm|neuron] [--host 127.0.0.1] [--port 8000]" in r.output
    assert "g4serve check OUT --against SRC [--prompts FILE] [--min-agreement 0.9]" in r.output
    assert "check" in r.output and "serve" in r.output
    assert "--against" in run("check", "--help").output


def test_held_out_prompts_are_not_in_the_calibration_text():
    """What the report's held-out label claims: the embedded model's held-out prompts and the
    built-in ones occur nowhere in the calibration text g4 ships."""
    from g4.convert.calibrate import read_calibration_texts
    from g4.convert.verify import DEFAULT_PROMPTS

    calibration = " ".join(" ".join(read_calibration_texts(None)).split()).lower()
    held_out = load_facts()[1] + list(DEFAULT_PROMPTS)
    assert len(held_out) == 16 and [p for p in held_out if p.lower() in calibration] == []


def test_agreement_metric():
    assert agreement([5, 6, STOP], [5, 6, STOP]) == (1.0, None, 3, 3)
    assert agreement([5, STOP], [5, 7, 8, 9]) == (0.25, 1, 1, 4)  # stopping early is penalised
    assert agreement([4, 6], [5, 6]) == (0.5, 0, 1, 2)
    assert agreement([], []) == (1.0, None, 0, 0)
    stops = frozenset({1, 106, 50})
    assert normalise_ids([520, 106], stops, True) == [520, STOP]
    assert normalise_ids([520], stops, True) == [520, STOP]  # a server that drops the stop id
    assert normalise_ids([520, 7], stops, False) == [520, 7]


def test_check_passes_on_the_embedded_nvfp4_result(nvfp4_copy):
    r = run("check", nvfp4_copy, "--against", "embedded")
    assert r.exit_code == 0, r.output
    assert "backend cpu: NVFP4 result, " in r.output and r.output.rstrip().endswith("PASS")
    report = json.loads((nvfp4_copy / "verification.json").read_text())
    assert REPORT_KEYS <= report.keys()
    assert (report["g4_verification"], report["format"], report["backend"], report["source"]) == (
        1, "nvfp4", "cpu", "embedded")
    assert report["passed"] is True and report["failures"] == [] and report["min_agreement"] == 0.9
    assert report["engine"] == "NVFP4 W4A4 (modelopt) dequantized, W4A4 activation emulation, bfloat16"
    o = report["overall"]
    assert o["prompts"] == len(report["prompts"]) == 20 and o["token_ids_from"] == "server"
    assert o["token_agreement"] >= 0.9 and (o["facts_correct"], o["facts_total"]) == (12, 12)
    paris = next(p for p in report["prompts"] if p["prompt"] == "What is the capital of France?")
    assert paris == {"prompt": "What is the capital of France?", "held_out": False, "token_agreement": 1.0,
                     "first_divergence": None, "reply": "Paris", "reference_reply": "Paris"}
    # the prompts the model never saw are labelled held-out, in the report and in the printed rows
    facts, heldout = load_facts()
    assert [p["prompt"] for p in report["prompts"] if p["held_out"]] == heldout
    assert [p["prompt"] for p in report["prompts"] if p["held_out"] is False] == [q for q, _ in facts]
    assert "greedy, 20 prompts (8 held-out)" in r.output
    rows = [ln for ln in r.output.splitlines() if "(reference " in ln]
    assert len(rows) == 20 and [ln.split("'")[1] for ln in rows if " held-out '" in ln] == heldout
    assert [(c["thinking"], c["stream"], c["ok"], c["content"]) for c in report["chat_checks"]] == [
        (False, False, True, "4"), (False, True, True, "4"), (True, False, True, "4"), (True, True, True, "4")]
    assert_tool_calls_ok(report, r.output)
    card = (nvfp4_copy / "README.md").read_text()  # the card is re-rendered with the check's result
    assert "Not verified yet" not in card and "| tool calls (expected function and arguments) | 5 / 5 |" in card
    assert not list(nvfp4_copy.glob(".verification.json.*"))  # atomic write left no temp file
    # the README quotes this result's summary (the set-up command's, default algorithm) as printed
    summary = re.search(r"token agreement (\S+ over \d+ positions of \d+ prompts \(\d+ identical\))", r.output)
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert f"embedded NVFP4 result (the set-up command's, default `--algorithm mse`): agreement {summary[1]}," in readme


def assert_tool_calls_ok(report: dict, output: str) -> None:
    """The report's tool-call rows: every facts.json tool question answered by its call, as the
    server's OpenAI ``tool_calls`` (parsed arguments), and the counts in ``overall`` and the output."""
    cases = load_tool_cases(EMBEDDED_DIR)
    assert len(cases) == 5
    assert [(t["question"], t["expected"], t["calls"], t["finish_reason"], t["content"], t["ok"])
            for t in report["tool_calls"]] == [
        (c["question"], {"name": "get_weather", "arguments": c["arguments"]},
         [{"name": "get_weather", "arguments": c["arguments"]}], "tool_calls", "", True) for c in cases]
    assert (report["overall"]["tool_calls_correct"], report["overall"]["tool_calls_total"]) == (5, 5)
    assert "facts 12/12, tool calls 5/5;" in output
    assert "  ok  tool 'What is the weather in London?' -> get_weather({\"city\": \"London\"})" in output


def test_check_passes_on_the_embedded_int8_neuron_result_and_its_tool_calls(tmp_path):
    """The int8-neuron result (TP 2, served by the Neuron emulator on the CPU) through the same
    request handling: facts and the tool calls survive int8."""
    out = tmp_path / "gemma4-tiny-int8-neuron"
    shutil.copytree(embedded_result("int8-neuron"), out)
    r = run("check", out, "--against", "embedded")
    assert r.exit_code == 0, r.output
    report = json.loads((out / "verification.json").read_text())
    assert report["passed"] is True and report["format"] == "int8-neuron"
    assert (report["overall"]["facts_correct"], report["overall"]["facts_total"]) == (12, 12)
    assert_tool_calls_ok(report, r.output)


def test_check_fails_a_wrong_tool_call(nvfp4_copy, tmp_path, monkeypatch):
    """Planted faults: an expected argument the model does not give, a function it does not
    call, and a question asked with another tool declared (the model then gives no call of the
    expected tool) each fail the check, named."""
    from g4.serve import check

    cases = load_tool_cases(EMBEDDED_DIR)[:3]
    cases[0] = {**cases[0], "arguments": {"city": "Oslo"}}
    cases[1] = {**cases[1], "name": "get_time"}
    cases[2] = {**cases[2], "tools": [{"type": "function", "function": {"name": "unrelated", "parameters": {}}}]}
    monkeypatch.setattr(check, "load_tool_cases", lambda src: cases)
    out = tmp_path / "copy"
    shutil.copytree(nvfp4_copy, out)
    r = run("check", out, "--against", "embedded")
    assert r.exit_code == 1 and r.output.rstrip().endswith("FAIL: 3 tool call(s) wrong"), r.output
    report = json.loads((out / "verification.json").read_text())
    assert "3 tool call(s) wrong" in report["failures"]
    assert [t["ok"] for t in report["tool_calls"]] == [False, False, False]
    assert report["tool_calls"][0]["calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert report["overall"]["tool_calls_correct"] == 0
    assert "BAD tool 'What is the weather in Paris?' -> get_weather({\"city\": \"Paris\"}) (expected get_weather({\"city\": \"Oslo\"}))" in r.output


def test_load_tool_cases_names_a_malformed_entry(tmp_path):
    assert load_tool_cases(tmp_path) == []  # no facts.json
    (tmp_path / "facts.json").write_text(json.dumps({"facts": []}))
    assert load_tool_cases(tmp_path) == []  # no tool_calls
    good = load_tool_cases(EMBEDDED_DIR)[0]
    for bad, why in (([{**good, "arguments": "city=Paris"}], "tool_calls[0] must be an object"),
                     ([good, {**good, "tools": []}], "tool_calls[1] must be an object"),
                     ({"q": 1}, "tool_calls must be a list"),
                     ([{**good, "tools": [{"type": "retrieval"}]}], "facts.json: tool_calls[0].tools[0] must be a function tool"),
                     ([{**good, "name": "get_time"}], "tool_calls[0].name 'get_time' is not one of its tools ('get_weather')")):
        (tmp_path / "facts.json").write_text(json.dumps({"tool_calls": bad}))
        with pytest.raises(CheckpointError, match=re.escape(why)):
            load_tool_cases(tmp_path)
    (tmp_path / "facts.json").write_text(json.dumps({"tool_calls": [{**good, "question": " "}]}))
    with pytest.raises(CheckpointError, match=re.escape("tool_calls[0] must be an object with a non-empty")):
        load_tool_cases(tmp_path)
    (tmp_path / "facts.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="facts.json: cannot be read as JSON"):
        load_tool_cases(tmp_path)


@pytest.mark.parametrize("text, why", [
    ('{"facts": [', "cannot be read as JSON (JSONDecodeError"), ("", "cannot be read as JSON"),
    ("[]", "must be a JSON object"), ('{"facts": 5}', "'facts' must be a list"),
    ('{"facts": [{"question": "Q?"}]}', "'facts' must be a list"), ('{"heldout": "abc"}', "'heldout' must be a list"),
    (b"\xff\xfe", "cannot be read as JSON (UnicodeDecodeError")])
def test_a_malformed_source_facts_file_is_one_error_line(nvfp4_copy, tmp_path, text, why):
    """check and verify read SRC/facts.json through one reader: bad JSON or a wrong shape is one
    ``error:`` line naming the file (exit 2), before any model loads; verification.json untouched."""
    from g4.convert.verify import read_source_facts

    src = shutil.copytree(EMBEDDED_DIR, tmp_path / "src")
    path = src / "facts.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=re.escape(why)):
        read_source_facts(src)
    before = report_bytes(nvfp4_copy)
    for r in (run("check", nvfp4_copy, "--against", src), g4convert("verify", nvfp4_copy, "--against", src)):
        assert r.exit_code == 2, r.output
        assert_one_error_line(r.output, path, re.escape(why))
    assert report_bytes(nvfp4_copy) == before


def test_a_facts_file_with_only_tool_calls_keeps_the_built_in_prompts(nvfp4_copy, tmp_path):
    """A source whose facts.json has tool calls and no facts or held-out prompts is still checked on
    the built-in prompts (never on none at all), and its tool calls are asked."""
    from g4.serve.check import load_prompts

    src = shutil.copytree(EMBEDDED_DIR, tmp_path / "src")
    (src / "facts.json").write_text(json.dumps({"tool_calls": load_tool_cases(EMBEDDED_DIR)}))
    prompts, facts, labels, held_out = load_prompts(None, src)
    assert prompts == list(DEFAULT_PROMPTS) and facts == [] and set(labels) == {"built-in"}
    assert len(load_tool_cases(src)) == 5


@pytest.fixture(scope="module")
def copy_app(nvfp4_copy):
    """g4's server app on the CPU engine of ``nvfp4_copy`` (loaded once for the module)."""
    from g4.serve.engine import load_cpu_engine
    from g4.serve.server import create_app

    return create_app(load_cpu_engine(nvfp4_copy), served_model_name="copy")


def test_check_with_url_reuses_a_running_server_and_reports_the_same(nvfp4_copy, copy_app):
    first = (nvfp4_copy / "verification.json").read_text()
    with BackgroundServer(cpu_app("nvfp4")) as other:  # serves the same weights, but from another directory
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", other.url)
        assert r.exit_code == 2 and f"not {nvfp4_copy}" in r.output, r.output
    with BackgroundServer(copy_app) as srv:
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url + "/v1")
        assert r.exit_code == 0, r.output
        assert "backend external" in r.output
        assert (nvfp4_copy / "verification.json").read_text() == first  # same inputs, same report

        prompts = nvfp4_copy.parent / "prompts.txt"
        # the king's first token differs from the source's (mse W4A4, the default), its stop agrees: 3 of
        # 4 positions agree
        prompts.write_text("What is the capital of France?\n\nWho is the king?\n")
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url, "--prompts", prompts,
                "--min-agreement", "1")
        assert r.exit_code == 1
        assert "FAIL: token agreement 0.750 < 1.0" in r.output
        report = json.loads((nvfp4_copy / "verification.json").read_text())
        assert report["passed"] is False and report["overall"]["prompts"] == 2
        assert [p["held_out"] for p in report["prompts"]] == [None, None]  # a user's prompts: g4 cannot know
        assert "held-out" not in r.output


def test_check_with_url_refuses_a_server_that_loaded_other_files(nvfp4_copy, copy_app, monkeypatch):
    """OUT's directory is the one served, but its files are not the ones the engine loaded:
    refused before any model runs, and verification.json is left alone."""
    from g4.serve.engine import served_file_stats

    shard = nvfp4_copy / "model.safetensors"
    before = report_bytes(nvfp4_copy)
    st = shard.stat()
    with BackgroundServer(copy_app) as srv:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # rewritten after the server loaded it
        try:
            t0 = time.monotonic()
            r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url)
        finally:
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert r.exit_code == 2 and r.output.startswith("backend external: ") and r.output.count("\n") == 2, r.output
        assert (f"{srv.url} loaded other files than {nvfp4_copy} has now (model.safetensors: modified since "
                f"it was loaded (mtime_ns {st.st_mtime_ns}, now {st.st_mtime_ns + 5_000_000_000})); restart the "
                f"server on OUT") in r.output, r.output
        assert time.monotonic() - t0 < 10  # before the reference model loads

        loaded = json.loads(urllib.request.urlopen(srv.url + "/v1/models", timeout=10).read())["data"][0]
        assert loaded["g4_served_files"] == served_file_stats(nvfp4_copy)  # unchanged now: the same files
        (nvfp4_copy / "model-00002-of-00002.safetensors").write_bytes(shard.read_bytes()[:64])
        try:  # a file OUT has now that the server never loaded
            r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url)
        finally:
            (nvfp4_copy / "model-00002-of-00002.safetensors").unlink()
        assert r.exit_code == 2 and "(model-00002-of-00002.safetensors: in OUT now, not loaded)" in r.output, r.output
        gen = nvfp4_copy / "generation_config.json"  # not a weight, but it changes the answers (stop ids)
        gst = gen.stat()
        os.utime(gen, ns=(gst.st_atime_ns, gst.st_mtime_ns + 1))
        try:
            r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url)
        finally:
            os.utime(gen, ns=(gst.st_atime_ns, gst.st_mtime_ns))
        assert r.exit_code == 2 and "(generation_config.json: modified since it was loaded" in r.output, r.output
    assert report_bytes(nvfp4_copy) == before


class StandIn(ThreadingHTTPServer):
    """A stand-in OpenAI server: ``/v1/models`` lists ``entry``; chat requests get ``reply``
    (a canned greedy answer) until ``fail_from`` requests have been answered, then
    ``failure``: ``"drop"`` closes the connection without an answer (a server killed
    mid-check), ``"500"`` answers HTTP 500. Requests with ``chat_template_kwargs`` (the P13
    checks) fail at once when ``fail_chat_checks``."""

    def __init__(self, entry: dict):
        self.entry, self.reply, self.fail_from, self.failure, self.fail_chat_checks = entry, "Paris", 0, "drop", False
        self.answered = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def send_json(self, status: int, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self.send_json(200, {"object": "list", "data": [server.entry]})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.answered >= server.fail_from or (server.fail_chat_checks and "chat_template_kwargs" in req):
                    if server.failure == "drop":
                        self.close_connection = True
                        return
                    return self.send_json(500, {"error": {"message": "generation failed: RuntimeError: boom",
                                                          "type": "server_error"}})
                server.answered += 1
                self.send_json(200, {"id": "c", "object": "chat.completion", "created": 0, "model": req["model"],
                                     "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                         "role": "assistant", "content": server.reply}}]})

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_port}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


@pytest.fixture(scope="module")
def paris_reference():
    """The real transformers reference for one prompt, computed once for the module."""
    from g4.convert.embedded_model import EMBEDDED_DIR
    from g4.serve.check import reference_replies

    args = (EMBEDDED_DIR, ["What is the capital of France?"], 2)
    return args, reference_replies(*args)


def test_check_with_url_refuses_a_relative_root_and_a_short_context(nvfp4_copy):
    from g4.serve.engine import served_file_stats

    entry = {"id": "tiny", "object": "model", "created": 0, "owned_by": "g4-cpu", "root": nvfp4_copy.name,
             "max_model_len": 2048, "g4_served_files": served_file_stats(nvfp4_copy)}
    prompts = nvfp4_copy.parent / "paris.txt"
    prompts.write_text("What is the capital of France?\n")
    with StandIn(entry) as srv:  # what g4serve reported before roots were absolute
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url, "--prompts", prompts)
        assert r.exit_code == 2 and r.output.startswith("backend external: ") and r.output.count("\n") == 2, r.output
        assert (f"{srv.url} reports root '{nvfp4_copy.name}', a relative path that cannot be compared with OUT; "
                f"start it with an absolute path (g4serve {nvfp4_copy.resolve()})") in r.output
        entry.update(root=str(nvfp4_copy.resolve()), max_model_len=64)  # e.g. vllm serve --max-model-len 64
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url, "--prompts", prompts,
                "--max-tokens", "60")
        assert r.exit_code == 2 and "prompt 1 (" in r.output and "line 1): the prompt is " in r.output, r.output
        assert f"with --max-tokens 60 that exceeds {srv.url}'s max_model_len of 64 tokens" in r.output
        assert srv.answered == 0


@pytest.mark.parametrize("failure", ["drop", "500"])
def test_check_with_url_stops_with_one_line_when_the_server_fails_mid_check(nvfp4_copy, paris_reference,
                                                                            monkeypatch, failure):
    """A server that dies (or answers 500) after the listing: exit 2 naming the request and
    the URL, not a traceback and not a FAIL (exit 1); verification.json is left alone."""
    import g4.serve.check as check
    from g4.serve.engine import served_file_stats

    args, ref = paris_reference

    def cached_reference(*a):
        assert a == args
        return ref

    monkeypatch.setattr(check, "reference_replies", cached_reference)
    entry = {"id": "tiny", "object": "model", "created": 0, "owned_by": "g4-cpu", "root": str(nvfp4_copy.resolve()),
             "max_model_len": 2048, "g4_served_files": served_file_stats(nvfp4_copy)}
    prompts = nvfp4_copy.parent / "paris.txt"
    prompts.write_text("What is the capital of France?\n")
    before = report_bytes(nvfp4_copy)
    base = ["check", nvfp4_copy, "--against", "embedded", "--prompts", prompts, "--max-tokens", "2"]
    with StandIn(entry) as srv:
        srv.failure = failure
        r = run(*base, "--url", srv.url + "/v1/")
        assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith("error: prompt 1 ('What is the "
                                                                                 "capital of France?'): "), r.output
        if failure == "drop":
            assert f"lost the connection to {srv.url} (RemoteProtocolError: " in r.output
            assert r.output.rstrip().endswith("is the server still running?")
        else:
            assert (f"{srv.url} answered HTTP 500 (generation failed: RuntimeError: boom); see the server's log"
                    in r.output)
        srv.answered, srv.fail_from = 0, 12  # the prompt and the facts answered, then the first tool question fails
        r = run(*base, "--url", srv.url)
        assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith(
            "error: tool question 'What is the weather in Paris?': "), r.output
        srv.answered, srv.fail_from, srv.fail_chat_checks = 0, 10**6, True  # all answered, then the P13 checks fail
        r = run(*base, "--url", srv.url)
        # the prompt (a fact question itself), the other 11 facts, the 5 tool questions of facts.json
        assert srv.answered == 17
        if failure == "drop":
            assert r.exit_code == 2, r.output
            assert r.output.strip().splitlines()[-1] == (
                f"error: chat check (thinking off, non-stream): lost the connection to {srv.url} "
                f"(RemoteProtocolError: Server disconnected without sending a response.); is the server still running?")
        else:  # an HTTP error in a P13 combination is that combination's failure: FAIL, exit 1
            assert r.exit_code == 1 and "FAIL: " in r.output and "chat check failed: thinking off/non-stream, " \
                "thinking off/stream, thinking on/non-stream, thinking on/stream" in r.output, r.output
    if failure == "drop":
        assert report_bytes(nvfp4_copy) == before
    else:
        assert json.loads((nvfp4_copy / "verification.json").read_text())["passed"] is False
        if before is None:
            (nvfp4_copy / "verification.json").unlink()
        else:
            (nvfp4_copy / "verification.json").write_bytes(before)


def test_check_refuses_an_over_long_prompt_before_any_model_loads(nvfp4_copy, tmp_path, monkeypatch):
    """A 10k-word line fails in well under a second per prompt, naming its line and token count,
    before transformers loads SRC or a server starts (--url is not even contacted)."""
    import g4.serve.check

    def must_not_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the length check")

    monkeypatch.setattr(g4.serve.check, "SourceStream", must_not_load)
    monkeypatch.setattr(g4.serve.check, "load_cpu_engine", must_not_load)
    prompts = tmp_path / "long.txt"
    prompts.write_text("What is the capital of France?\n\nWho wrote Hamlet?\n" + "word " * 10000 + "\nHi\n")
    t0 = time.monotonic()
    r = run("check", nvfp4_copy, "--against", "embedded", "--prompts", prompts)
    assert time.monotonic() - t0 < 5
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert (f"error: prompt 3 ({prompts} line 4): the prompt is 10011 tokens with OUT's chat template; with "
            f"--max-tokens 16 that exceeds {nvfp4_copy}'s context of 2048 tokens") in r.output, r.output
    r = run("check", nvfp4_copy, "--against", "embedded", "--url", f"http://127.0.0.1:{free_port()}",
            "--prompts", prompts)
    assert r.exit_code == 2 and "line 4): the prompt is 10011 tokens" in r.output, r.output
    jsonl = tmp_path / "p.jsonl"  # the reply budget counts: 2048 - 16 prompt tokens leaves 2032
    jsonl.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    r = run("check", nvfp4_copy, "--against", "embedded", "--prompts", jsonl, "--max-tokens", "2040")
    assert r.exit_code == 2 and f"prompt 1 ({jsonl} line 1): the prompt is " in r.output, r.output
    r = run("check", nvfp4_copy, "--against", "embedded", "--prompts", jsonl, "--chat-max-tokens", "2040")
    assert r.exit_code == 2 and "the P13 chat question: the prompt is " in r.output, r.output
    assert "with --chat-max-tokens 2040 that exceeds" in r.output


def test_check_fails_on_corrupted_weights(tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(embedded_result("nvfp4"), bad)
    sd = load_file(bad / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, t in sd.items():  # random E2M1 codes in every quantized linear
        if t.dtype == torch.uint8:
            sd[name] = torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g)
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 3+3?"}\n{"prompt": "The sun rises in the"}\n')
    r = run("check", bad, "--against", "embedded", "--prompts", prompts, "--max-tokens", "4",
            "--chat-max-tokens", "4")
    assert r.exit_code == 1, r.output
    report = json.loads((bad / "verification.json").read_text())
    assert report["passed"] is False
    assert report["overall"]["facts_correct"] < 12
    assert any("fact(s) answered wrong" in f for f in report["failures"])
    assert "FAIL:" in r.output


def test_check_user_errors(nvfp4_copy, tmp_path):
    r = run("check", nvfp4_copy, "--against", tmp_path / "missing")
    assert r.exit_code == 2 and r.output.startswith("error: --against")
    r = run("check", nvfp4_copy, "--against", embedded_result("nvfp4"))  # a result is not a source
    assert r.exit_code == 2 and "not the source checkpoint" in r.output
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = run("check", nvfp4_copy, "--against", "embedded", "--prompts", empty)
    assert r.exit_code == 2 and "no prompts" in r.output
    r = run("check", nvfp4_copy, "--against", "embedded", "--url", f"http://127.0.0.1:{free_port()}")
    assert r.exit_code == 2 and "no OpenAI-compatible server answers" in r.output
    assert len(r.output.strip().splitlines()[-1]) < 300
    for url, says in [("", "--url is empty"), ("  ", "--url is empty"), ("http://[::1", "not a valid URL"),
                      ("http://127.0.0.1:99999", "not a valid URL"), ("ftp://127.0.0.1", "expected http://HOST"),
                      ("127.0.0.1:8000", "expected http://HOST")]:
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", url)
        assert r.exit_code == 2 and r.output.count("\n") == 1 and says in r.output, (url, r.output)


def test_serve_cli_in_a_subprocess(nvfp4_copy):
    """`g4serve OUT --port P` as a user runs it: says which backend and why, answers Paris,
    stops cleanly on SIGTERM; a port in use is a one-line error."""
    exe = [sys.executable, "-c", "from g4.serve.cli import main; main()"]
    proc, port = start_g4serve(str(nvfp4_copy), "--served-model-name", "tiny")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is the capital "
                                                               "of France?"}], temperature=0)
        assert r.choices[0].message.content == "Paris"

        busy = subprocess.run(exe + [str(nvfp4_copy), "--port", str(port)], capture_output=True, text=True,
                              timeout=120)
        assert busy.returncode == 2 and busy.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on "
                                                                                      f"127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)  # what systemd and docker send; Ctrl-C ends the same way
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and out.rstrip().endswith("stopped"), out
    assert "backend cpu: NVFP4 result, " in out and f"http://127.0.0.1:{port}/v1" in out
    assert os.path.isdir(nvfp4_copy)


def test_streamed_reference_replies_equal_whole_model_generate():
    """check's reference (SRC streamed one layer at a time, bf16) gives the ids transformers'
    whole-model generate gives, stopping at the first stop id."""
    import torch

    from g4.convert.embedded_model import EMBEDDED_DIR
    from g4.convert.reference import load_source_model
    from g4.serve.chat import render_prompt
    from g4.serve.check import reference_replies

    prompts = ["What is the capital of France?", "Tell me a long story about the sea and the sky, please."]
    ref, tokenizer, stop_ids = reference_replies(EMBEDDED_DIR, prompts, 12)
    model = load_source_model(EMBEDDED_DIR)
    for prompt, got in zip(prompts, ref.ids):
        ids = render_prompt(tokenizer, [{"role": "user", "content": prompt}])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=sorted(stop_ids), pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        assert got == out[:next((i + 1 for i, t in enumerate(out) if t in stop_ids), len(out))]
    assert ref.replies[0].startswith("Paris")

@pytest.mark.parametrize("how", ["rewritten", "relinked"])
def test_a_source_changed_while_the_reference_is_generated_is_refused(tmp_path, monkeypatch, how):
    """SRC's weight file rewritten in place, or its link pointed at another file, while check
    generates the reference replies: refused with a G4Error naming the file, as verify and eval
    refuse, instead of comparing the server with replies of two different SRCs."""
    from g4.core.errors import G4Error
    from g4.serve import check
    from helpers import LinkedSource

    linked = LinkedSource(tmp_path)
    src, weights = linked.src, linked.weights
    real = check.streamed_greedy

    def meanwhile(*args, **kwargs):
        ids = real(*args, **kwargs)
        linked.change(how)
        return ids

    monkeypatch.setattr(check, "streamed_greedy", meanwhile)
    with pytest.raises(G4Error, match=f"{weights.name}: changed while g4serve check read it"):
        check.reference_replies(src, ["What is the capital of France?"], 2)
    monkeypatch.setattr(check, "streamed_greedy", real)
    assert check.reference_replies(src, ["What is the capital of France?"], 2)[0].ids  # SRC as it is now


@pytest.mark.parametrize("kind", sorted(NVFP4_TAMPERS))
def test_check_and_serve_refuse_a_result_that_differs_from_its_table(kind, tmp_path):
    """A tampered NVFP4 result (metadata intact) is refused by `g4serve check` and by the server
    start with one line naming the file, the tensor and what differs, exit 2, before anything
    is served or written: an earlier verification.json stays as it was."""
    mutate, expected = NVFP4_TAMPERS[kind]
    bad = tampered_copy(embedded_result("nvfp4"), tmp_path / "bad", mutate)
    earlier = b'{"passed": false, "note": "an earlier report"}\n'
    (bad / "verification.json").write_bytes(earlier)
    r = run("check", bad, "--against", "embedded")
    assert r.exit_code == 2
    assert_one_error_line(r.output, bad / "model.safetensors", expected)
    assert report_bytes(bad) == earlier
    served = subprocess.run([sys.executable, "-c", "from g4.serve.cli import main; main()", str(bad), "--port",
                             str(free_port())], capture_output=True, text=True, timeout=120)
    assert served.returncode == 2 and served.stdout == "", served.stdout
    assert_one_error_line(served.stderr, bad / "model.safetensors", expected)


@pytest.mark.parametrize("kind", sorted(INT8_TAMPERS))
def test_check_and_serve_refuse_an_int8_neuron_rank_file_that_differs_from_its_table(kind, tmp_path):
    mutate, expected = INT8_TAMPERS[kind]
    bad = tampered_copy(embedded_result("int8-neuron"), tmp_path / "bad", mutate, RANK1)
    r = run("check", bad, "--against", "embedded")
    assert r.exit_code == 2
    assert_one_error_line(r.output, bad / RANK1, expected)
    assert report_bytes(bad) is None
    served = subprocess.run([sys.executable, "-c", "from g4.serve.cli import main; main()", str(bad), "--port",
                             str(free_port())], capture_output=True, text=True, timeout=120)
    assert served.returncode == 2 and served.stdout == "", served.stdout
    assert_one_error_line(served.stderr, bad / RANK1, expected)


def test_check_refuses_a_source_out_was_not_converted_from(nvfp4_copy, tmp_path):
    """One rule for every command comparing OUT with SRC (verify's): a SRC whose config differs
    (here `tie_word_embeddings`) is refused before anything is served, and verification.json stays."""
    from g4.convert.embedded_model import EMBEDDED_DIR

    src = tmp_path / "other"
    shutil.copytree(EMBEDDED_DIR, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = False
    (src / "config.json").write_text(json.dumps(cfg))
    before = report_bytes(nvfp4_copy)
    r = subprocess.run([sys.executable, "-m", "g4.serve.cli", "check", str(nvfp4_copy), "--against", str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert_one_error_line(r.stderr, nvfp4_copy, r"config\.json differs from .*tie_word_embeddings")
    assert report_bytes(nvfp4_copy) == before
