"""The g4convert command line: exit codes and one-line errors."""

import os
import shutil
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import tiny
from helpers import g4convert
from g4.convert.cli import main


run = g4convert


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

    from g4.exporters import output_dir

    monkeypatch.setattr(output_dir.shutil, "disk_usage", lambda p: sh._ntuple_diskusage(10**9, 10**9, 1000))
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only")
    assert r.exit_code == 2 and r.output.startswith(f"error: {tmp_path}: 1.000 kB free, the result needs ")
    assert r.output.rstrip().endswith(" kB"), r.output  # the weight-only tiny result, not "0.00 GB"
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.partial-*"))


def test_weight_only_rejects_calibration_options(tiny_mm, tmp_path):
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only", "--calib-samples", "4")
    assert r.exit_code == 2 and "--weight-only does not calibrate" in r.output


def test_kv_cache_dtype_fp8_calibrates_even_weight_only(tiny_mm, tmp_path):
    """--kv-cache-dtype fp8 with --weight-only takes the calibration options (its KV scales are
    calibrated) and writes W4A16 weights with a k_scale / v_scale per layer."""
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only", "--kv-cache-dtype", "fp8",
            "--calib-samples", "2", "--calib-seq-len", "16")
    assert r.exit_code == 0, r.output
    names = tiny.tensor_names(tmp_path / "o")
    assert {n for n in names if n.endswith(("k_scale", "v_scale"))} == {
        f"model.language_model.layers.{L}.self_attn.{s}" for L in range(2) for s in ("k_proj.k_scale", "v_proj.v_scale")}
    assert not [n for n in names if n.endswith("input_scale")]
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o2"), "--kv-cache-dtype", "fp16")
    assert r.exit_code == 2 and "'--kv-cache-dtype'" in r.output and not (tmp_path / "o2").exists()


def test_out_appearing_during_a_conversion_is_kept_and_the_result_named(tiny_mm, tmp_path, monkeypatch):
    """Someone makes OUT while g4convert works: exit 2, one error line, their file intact, the
    finished result beside OUT under the name the message gives."""
    from g4.convert import nvfp4

    out = tmp_path / "o"
    copy_side_files = nvfp4.copy_side_files

    def meanwhile(*args):
        out.mkdir()
        (out / "mine.txt").write_text("user's")
        copy_side_files(*args)

    monkeypatch.setattr(nvfp4, "copy_side_files", meanwhile)
    r = run("nvfp4", str(tiny_mm), str(out), "--weight-only")
    assert r.exit_code == 2 and r.output.startswith("error: ") and r.output.count("\n") == 1, r.output
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "user's"
    kept = r.output.strip().rsplit(" ", 1)[-1]
    assert "appeared while this run was converting" in r.output and (Path(kept) / "hf_quant_config.json").is_file()
    assert not list(tmp_path.glob(".o.*"))


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


@pytest.fixture
def own_signal_handlers():
    """The CLI installs its own SIGINT / SIGTERM handlers; put the test process's back after."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_whose_exception_a_library_swallows_still_stops_the_run(tiny_mm, tmp_path, monkeypatch, sig, code,
                                                                        own_signal_handlers):
    """Twice in ~32 tries a signal was lost and the run ended 0 with a complete OUT: something on
    the way caught its KeyboardInterrupt (a broad except, as in a compile step). The handler
    records the signal, so OUT is not placed and the exit status is still 128 + the signal."""
    from g4.convert import nvfp4

    def swallowing_library(*args):
        try:
            os.kill(os.getpid(), sig)
            for _ in range(100):  # the handler runs at the next bytecode
                pass
        except BaseException:  # noqa: BLE001 - what the library does
            pass

    monkeypatch.setattr(nvfp4, "copy_side_files", swallowing_library)
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only")
    assert r.exit_code == code and "nothing was written to OUT" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_a_signal_while_out_is_placed_exits_130_and_says_out_is_complete(tiny_mm, tmp_path, monkeypatch,
                                                                         own_signal_handlers):
    """Ctrl-C in the last moment (signals are held while OUT is renamed into place): exit 130, and
    the message says OUT is complete and kept, not that nothing was written."""
    from g4.exporters import output_dir

    real_place = output_dir._place

    def place(*args):
        os.kill(os.getpid(), signal.SIGINT)  # held: delivered when the swap is done
        return real_place(*args)

    monkeypatch.setattr(output_dir, "_place", place)
    r = run("nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only")
    assert r.exit_code == 130 and "was complete; it is kept" in r.output, r.output
    assert (tmp_path / "o" / "config.json").is_file()


def test_ctrl_c_while_starting_is_one_line_without_a_traceback(tiny_mm, tmp_path):
    """The console script installs its start-up guard before importing torch (g4.convert.entry)."""
    import subprocess
    import sys
    import time

    script = Path(sys.executable).parent / "g4convert"
    p = subprocess.Popen([str(script), "nvfp4", str(tiny_mm), str(tmp_path / "o"), "--weight-only"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # importing torch and transformers takes seconds
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted"), err
    assert list(tmp_path.iterdir()) == []


def test_out_inside_src_is_refused(tiny_mm, tmp_path, monkeypatch):
    """OUT inside SRC would write into the source directory: refused for every converter, also
    when it comes from the default OUT name with SRC as the working directory."""
    src = shutil.copytree(tiny_mm, tmp_path / "src")
    before = sorted(p.name for p in src.iterdir())
    for args in (["nvfp4", str(src), str(src / "sub" / ".." / "o"), "--weight-only"],
                 ["int8-neuron", str(src), str(src / "o"), "--tp", "1"]):
        r = run(*args)
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert f"OUT is inside SRC {src}" in r.output
    monkeypatch.chdir(src)
    r = run("nvfp4", ".", "--weight-only")
    assert r.exit_code == 2 and "OUT is inside SRC" in r.output, r.output
    assert sorted(p.name for p in src.iterdir()) == before


def test_no_local_spec_paths_in_package_readme_or_help():
    """../shared does not ship with g4: messages, docstrings, the README and --help cite public sources."""
    from pathlib import Path

    import click

    from g4.serve.cli import main as serve_main

    root = Path(__file__).resolve().parents[2]
    files = [root / "README.md"] + [p for d in ("core", "convert", "quantizers", "exporters", "serve") for p in (root / d).rglob("*.py")]
    assert len(files) > 30
    assert [str(p.relative_to(root)) for p in files if "../shared" in p.read_text()] == []

    def helps(group, prefix):
        for name, cmd in group.commands.items():
            yield CliRunner().invoke(group, [name, "--help"], prog_name=prefix).output
            if isinstance(cmd, click.Group):
                yield from helps(cmd, f"{prefix} {name}")

    texts = list(helps(main, "g4convert")) + list(helps(serve_main, "g4serve"))
    assert len(texts) >= 8 and all("Usage:" in t for t in texts)
    assert [t.splitlines()[0] for t in texts if "../shared" in t] == []


@pytest.mark.parametrize("command", ["nvfp4", "int8-neuron"])
def test_existing_out_is_refused_before_src_is_resolved(command, tmp_path, monkeypatch):
    """An existing OUT without --overwrite: one error line naming OUT, before SRC is fetched or
    read and before the plan table (not quiet, as a user runs it); OUT is left as it was."""
    import g4.convert.cli as cli

    def no_source(src, **kwargs):
        raise AssertionError(f"SRC {src} resolved although OUT exists")

    monkeypatch.setattr(cli, "resolve_source", no_source)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = run(command, "embedded", str(out), quiet=False)
    assert r.exit_code == 2, r.output
    assert r.output == f"error: {out}: already exists; choose another OUT or pass --overwrite\n"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_int8_neuron_bad_tp_names_the_degrees_that_work(tmp_path):
    """--tp 3 on the embedded model: the error lists the TP degrees that work, the same problems
    and degrees as `g4convert plan` (one rule, core/gemma4.py), and plan accepts each of them."""
    from helpers import one_error_line

    line = one_error_line(run("int8-neuron", "embedded", tmp_path / "o", "--tp", "3"),
                          "tensor parallel degree 3 cannot be used: ", "(TP degrees that work: 1, 2, 4)")
    planned = one_error_line(run("plan", "embedded", "--format", "int8-neuron", "--tp", "3"))
    assert line.split(" cannot be used: ")[1] == planned.split(" cannot be mapped onto this model: ")[1]
    for tp in (1, 2, 4):
        r = run("plan", "embedded", "--format", "int8-neuron", "--tp", tp, "--target", "inf2.24xlarge")
        assert r.exit_code == 0, r.output
    assert not (tmp_path / "o").exists()
