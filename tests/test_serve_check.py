"""`g4serve check` end to end and the `g4serve` command line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from test_serve_fixtures import cpu_app, embedded_result

from g4.serve.check import STOP, agreement, free_port, normalise_ids
from g4.serve.cli import main
from g4.serve.server import BackgroundServer

REPORT_KEYS = {"g4_verification", "format", "backend", "engine", "source", "min_agreement", "passed", "failures", "overall",
               "prompts", "facts", "chat_checks"}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


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
    assert paris == {"prompt": "What is the capital of France?", "token_agreement": 1.0, "first_divergence": None,
                     "reply": "Paris", "reference_reply": "Paris"}
    assert [(c["thinking"], c["stream"], c["ok"], c["content"]) for c in report["chat_checks"]] == [
        (False, False, True, "4"), (False, True, True, "4"), (True, False, True, "4"), (True, True, True, "4")]
    assert not list(nvfp4_copy.glob(".verification.json.*"))  # atomic write left no temp file


def test_check_with_url_reuses_a_running_server_and_reports_the_same(nvfp4_copy):
    from g4.serve.engine import load_cpu_engine
    from g4.serve.server import create_app

    first = (nvfp4_copy / "verification.json").read_text()
    with BackgroundServer(cpu_app("nvfp4")) as other:  # serves the same weights, but from another directory
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", other.url)
        assert r.exit_code == 2 and f"not {nvfp4_copy}" in r.output, r.output
    with BackgroundServer(create_app(load_cpu_engine(nvfp4_copy), served_model_name="copy")) as srv:
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url + "/v1")
        assert r.exit_code == 0, r.output
        assert "backend external" in r.output
        assert (nvfp4_copy / "verification.json").read_text() == first  # same inputs, same report

        prompts = nvfp4_copy.parent / "prompts.txt"
        prompts.write_text("What is the capital of France?\n\nWho wrote Hamlet?\n")
        r = run("check", nvfp4_copy, "--against", "embedded", "--url", srv.url, "--prompts", prompts,
                "--min-agreement", "1.01")
        assert r.exit_code == 1
        assert "FAIL: token agreement 1.000 < 1.01" in r.output
        report = json.loads((nvfp4_copy / "verification.json").read_text())
        assert report["passed"] is False and report["overall"]["prompts"] == 2


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
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("word " * 3000 + "\n")
    r = run("check", nvfp4_copy, "--against", "embedded", "--prompts", long_prompt)
    assert r.exit_code == 2 and "prompt 1" in r.output and "refused" in r.output, r.output
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = run("check", nvfp4_copy, "--against", "embedded", "--prompts", empty)
    assert r.exit_code == 2 and "no prompts" in r.output
    r = run("check", nvfp4_copy, "--against", "embedded", "--url", f"http://127.0.0.1:{free_port()}")
    assert r.exit_code == 2 and "no OpenAI-compatible server answers" in r.output
    assert len(r.output.strip().splitlines()[-1]) < 300


def test_serve_cli_in_a_subprocess(nvfp4_copy):
    """`g4serve OUT --port P` as a user runs it: says which backend and why, answers Paris,
    stops cleanly on SIGTERM; a port in use is a one-line error."""
    port = free_port()
    exe = [sys.executable, "-c", "from g4.serve.cli import main; main()"]
    proc = subprocess.Popen(exe + [str(nvfp4_copy), "--port", str(port), "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
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
