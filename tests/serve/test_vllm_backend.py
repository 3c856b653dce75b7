"""The vLLM backend: the command pinned for GPU / version cases, and process handling
(readiness, early exit, whole-group stop) against a stand-in server process."""

import json
import os
import socket
import sys
import textwrap
import time

import pytest
from helpers import free_port

from g4.core.errors import G4Error
from g4.serve import vllm_backend as vb


@pytest.fixture
def nvfp4_dir(tmp_path):
    d = tmp_path / "nvfp4"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    return d


def _flags(argv):
    return " ".join(argv)


def test_blackwell_gets_no_kernel_pins(nvfp4_dir):
    cmd = vb.vllm_command(nvfp4_dir, compute_capability=(10, 0), vllm_version="0.33.0", port=8011,
                          served_model_name="g4", max_model_len=4096, kv_cache_dtype="fp8")
    assert cmd.argv[:3] == ["vllm", "serve", str(nvfp4_dir)]
    s = _flags(cmd.argv)
    assert "--quantization modelopt" in s and "--reasoning-parser gemma4" in s
    assert "--enable-auto-tool-choice --tool-call-parser gemma4" in s
    assert "--host 127.0.0.1 --port 8011" in s
    assert "--served-model-name g4" in s and "--max-model-len 4096" in s and "--kv-cache-dtype fp8" in s
    assert "marlin" not in s and cmd.env == {}


def test_hopper_new_vllm_pins_marlin_by_flags(nvfp4_dir):
    cmd = vb.vllm_command(nvfp4_dir, compute_capability=(9, 0), vllm_version="0.32.0")
    s = _flags(cmd.argv)
    assert "--moe-backend marlin" in s and "--linear-backend marlin" in s
    assert cmd.env == {}


@pytest.mark.parametrize("version", ["0.19.1", "0.20.2", "0.22.1"])
def test_hopper_old_vllm_pins_dense_marlin_by_env(nvfp4_dir, version):
    cmd = vb.vllm_command(nvfp4_dir, compute_capability=(9, 0), vllm_version=version)
    assert "--moe-backend" in cmd.argv and "--linear-backend" not in cmd.argv
    assert cmd.env == {"VLLM_NVFP4_GEMM_BACKEND": "marlin"}
    assert cmd.shell().startswith("VLLM_NVFP4_GEMM_BACKEND=marlin vllm serve ")


def test_ada_and_ampere_fall_back_to_marlin_too(nvfp4_dir):
    for cc in [(8, 9), (8, 0)]:
        assert "--moe-backend" in vb.vllm_command(nvfp4_dir, compute_capability=cc).argv


def test_version_0_23_uses_the_flag(nvfp4_dir):
    cmd = vb.vllm_command(nvfp4_dir, compute_capability=(9, 0), vllm_version="0.23.0")
    assert "--linear-backend" in cmd.argv and cmd.env == {}


def test_vllm_0_19_0_refused_for_nvfp4(nvfp4_dir):
    with pytest.raises(G4Error, match="0.19.1"):
        vb.vllm_command(nvfp4_dir, compute_capability=(10, 0), vllm_version="0.19.0")


def test_bf16_checkpoint_has_no_quantization_flag(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    argv = vb.vllm_command(tmp_path, compute_capability=(9, 0), vllm_version="0.19.0").argv
    assert "--quantization" not in argv and "marlin" not in _flags(argv)


def test_int8_neuron_and_bad_options_refused(tmp_path, nvfp4_dir):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "g4-int8-neuron/2"}))
    with pytest.raises(G4Error, match="neuron backend"):
        vb.vllm_command(tmp_path)
    with pytest.raises(G4Error, match="kv-cache-dtype"):
        vb.vllm_command(nvfp4_dir, kv_cache_dtype="int3")
    with pytest.raises(G4Error, match="max-model-len"):
        vb.vllm_command(nvfp4_dir, max_model_len=0)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(G4Error, match="FP8"):
        vb.vllm_command(bad)


def test_api_server_launcher_takes_model_flag(nvfp4_dir):
    argv = vb.vllm_command(nvfp4_dir, launcher=(sys.executable, "-m", "vllm.entrypoints.openai.api_server")).argv
    assert argv[3:5] == ["--model", str(nvfp4_dir)]


@pytest.mark.parametrize("text,expected", [("0.19.1", (0, 19, 1)), ("0.32.0+cpu", (0, 32, 0)),
                                           ("0.20.2rc1", (0, 20, 2)), ("1.0", (1, 0, 0))])
def test_parse_version(text, expected):
    assert vb.parse_version(text) == expected


def test_status_without_vllm_says_why(monkeypatch):
    monkeypatch.setattr(vb, "installed_vllm_version", lambda: None)
    assert vb.vllm_status() == (False, "vLLM is not installed")
    monkeypatch.setattr(vb, "installed_vllm_version", lambda: "0.32.0+cpu")
    monkeypatch.setattr(vb, "gpu_compute_capability", lambda: None)
    ok, why = vb.vllm_status()
    assert not ok and "no CUDA GPU" in why


# --- process handling, with a stand-in server that behaves like vLLM's (slow start, a child process) ---

_FAKE = textwrap.dedent("""
    import http.server, os, subprocess, sys, time
    port, delay, pidfile = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])   # like EngineCore
    open(pidfile, "w").write(str(child.pid))
    print("starting", flush=True)
    if delay < 0:
        sys.exit(3)
    time.sleep(delay)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")



def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _server(tmp_path, nvfp4_dir, delay):
    script = tmp_path / "fake_vllm.py"
    script.write_text(_FAKE)
    port = free_port()
    cmd = vb.VllmCommand([sys.executable, str(script), str(port), str(delay), str(tmp_path / "child.pid")])
    return vb.VllmServer(nvfp4_dir, port=port, command=cmd, log_path=tmp_path / "server.log"), port


def test_server_ready_then_whole_group_stopped(tmp_path, nvfp4_dir):
    server, port = _server(tmp_path, nvfp4_dir, delay=1.0)
    with server:
        server.wait_ready(timeout_s=30, poll_s=0.1)
        assert server.url == f"http://127.0.0.1:{port}/v1"
        child = int((tmp_path / "child.pid").read_text())
        assert _alive(child)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the server's child process outlived stop()"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "port still served after stop()"


def test_early_exit_reported_with_log(tmp_path, nvfp4_dir):
    server, _ = _server(tmp_path, nvfp4_dir, delay=-1)
    with server, pytest.raises(G4Error, match=r"exited with code 3 .*starting"):
        server.wait_ready(timeout_s=30, poll_s=0.1)


def test_not_ready_in_time(tmp_path, nvfp4_dir):
    server, _ = _server(tmp_path, nvfp4_dir, delay=60)
    with server, pytest.raises(G4Error, match="not ready after"):
        server.wait_ready(timeout_s=1.5, poll_s=0.1)


def test_missing_launcher(tmp_path, nvfp4_dir):
    server = vb.VllmServer(nvfp4_dir, command=vb.VllmCommand(["/nonexistent/vllm", "serve"]))
    with pytest.raises(G4Error, match="not found"):
        server.start()


def test_fp8_kv_cache_without_scales_is_warned(nvfp4_dir, tmp_path):
    """issue 18: `g4serve --kv-cache-dtype fp8` on an export without KV scales warns in one line
    and says how to get them; with modelopt's kv_cache_scheme it passes the flag, silently."""
    from g4.exporters.modelopt_nvfp4 import quantization_config
    from g4.exporters.vllm_command import kv_cache_warning

    warning = kv_cache_warning(nvfp4_dir, "fp8")
    assert warning.startswith("warning: ") and "\n" not in warning
    assert "no KV cache scales" in warning and "g4convert nvfp4 SRC OUT --kv-cache-dtype fp8" in warning
    assert kv_cache_warning(nvfp4_dir, "fp8_e4m3") and kv_cache_warning(nvfp4_dir, "auto") is None
    assert kv_cache_warning(nvfp4_dir, None) is None
    calibrated = tmp_path / "kv"
    calibrated.mkdir()
    config = {"model_type": "gemma4", "quantization_config": quantization_config([], weight_only=False, kv_cache=True)}
    (calibrated / "config.json").write_text(json.dumps(config))
    (calibrated / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    assert kv_cache_warning(calibrated, "fp8") is None
    assert "--kv-cache-dtype fp8" in _flags(vb.vllm_command(calibrated, kv_cache_dtype="fp8").argv)
