"""The g4convert command line: exit codes and one-line errors."""

import os
import shutil
import signal

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from g4.convert.cli import main


def run(*args):
    return CliRunner().invoke(main, ["-q", *args])


def test_nvfp4_then_refuse_existing(tiny_mm, tmp_path):
    out = tmp_path / "out"
    r = run("nvfp4", str(tiny_mm), str(out), "--calib-samples", "2", "--calib-seq-len", "32")
    assert r.exit_code == 0, r.output
    assert "linears NVFP4" in r.output and (out / "hf_quant_config.json").is_file()
    r = run("nvfp4", str(tiny_mm), str(out), "--weight-only")
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "already exists" in r.output


def test_bad_inputs_one_line_nonzero(tiny_mm, tmp_path):
    src = shutil.copytree(tiny_mm, tmp_path / "src")
    sd = load_file(src / "model.safetensors")
    sd["model.language_model.layers.0.experts.down_proj"][1, 2, 3] = float("inf")
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    r = run("nvfp4", str(src), str(tmp_path / "o1"), "--weight-only")
    assert r.exit_code == 2 and "model.safetensors: tensor model.language_model.layers.0.experts.down_proj: 1 NaN/Inf" in r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1
    r = run("nvfp4", str(tmp_path / "nowhere"), str(tmp_path / "o2"))
    assert r.exit_code == 2 and "nowhere: does not exist" in r.output
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o3"), "--max-shard-size", "lots")
    assert r.exit_code == 2 and "Invalid value for '--max-shard-size': cannot parse size 'lots'" in r.output
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o3"), "--max-shard-size", "0")
    assert r.exit_code == 2 and "Invalid value for '--max-shard-size': size must be positive, got '0'" in r.output
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


def test_disk_space_is_checked_before_writing(tiny_mm, tmp_path, monkeypatch):
    import shutil as sh

    from g4.exporters import safetensors_writer

    monkeypatch.setattr(safetensors_writer.shutil, "disk_usage", lambda p: sh._ntuple_diskusage(10**9, 10**9, 1000))
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only")
    assert r.exit_code == 2 and "GB free, the result needs" in r.output
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.partial-*"))


def test_weight_only_rejects_calibration_options(tiny_mm, tmp_path):
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only", "--calib-samples", "4")
    assert r.exit_code == 2 and "--weight-only does not calibrate" in r.output


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_exits_130_sigterm_143_and_nothing_is_left(tiny_mm, tmp_path, monkeypatch, sig, code):
    from g4.convert import nvfp4

    monkeypatch.setattr(nvfp4, "copy_side_files", lambda *a: os.kill(os.getpid(), sig))
    before = signal.getsignal(signal.SIGTERM)
    try:
        r = run("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert r.exit_code == code and "nothing was written to OUT" in r.output, r.output
    assert list(tmp_path.iterdir()) == []

