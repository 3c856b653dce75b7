"""The g4convert command line: exit codes and one-line errors."""

import shutil

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


def test_no_local_spec_paths_in_package_readme_or_help():
    """../shared does not ship with g4: messages, docstrings, the README and --help cite public sources."""
    from pathlib import Path

    import click

    from g4.serve.cli import main as serve_main

    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md"] + [p for d in ("convert", "quantizers", "exporters", "serve") for p in (root / d).rglob("*.py")]
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
