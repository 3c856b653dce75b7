"""Only typed g4 errors become one-line ``error:`` messages; a broken internal invariant
(any other exception, a bare ValueError included) stays a traceback."""

import pytest
from click.testing import CliRunner

from helpers import one_error_line

import g4.convert.cli
from g4.convert.cli import main
from g4.core.errors import OptionError
from g4.core.sizes import parse_size


def test_internal_value_error_is_not_turned_into_a_user_error(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise ValueError("internal invariant broken")

    monkeypatch.setattr(g4.convert.cli, "convert_nvfp4", broken)
    r = CliRunner().invoke(main, ["nvfp4", "embedded", str(tmp_path / "out")])
    assert isinstance(r.exception, ValueError) and not isinstance(r.exception, SystemExit)
    assert "error: internal invariant broken" not in r.output


def test_a_bad_size_is_a_typed_option_error():

    with pytest.raises(OptionError, match="has no unit"):
        parse_size("80")


@pytest.mark.parametrize("args", [
    ["g4convert", "nvfp4", "{src}", "{tmp}/o", "--weight-only"],
    ["g4convert", "nvfp4", "{src}", "{tmp}/o"],
    ["g4convert", "int8-neuron", "{src}", "{tmp}/o", "--tp", "1"],
    ["g4convert", "plan", "{src}", "--format", "nvfp4"],
    ["g4convert", "verify", "{out}", "--against", "{src}"],
    ["g4serve", "check", "{out}", "--against", "{src}"],
], ids=lambda a: " ".join(a[:2]))
def test_an_unknown_hidden_activation_is_one_error_line_on_every_command(tmp_path, args):
    """Fresh-user finding: an activation transformers does not compute converted with
    --weight-only (exit 0, unservable) and crashed W4A4, verify and check with a KeyError."""
    import json
    import shutil

    from serve_fixtures import embedded_result

    from g4.convert.embedded_model import EMBEDDED_DIR
    from g4.serve.cli import main as g4serve

    src = shutil.copytree(EMBEDDED_DIR, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["hidden_activation"] = "swiglu_typo"
    (src / "config.json").write_text(json.dumps(cfg))
    out = shutil.copytree(embedded_result("nvfp4"), tmp_path / "out")
    (out / "config.json").write_text(json.dumps(cfg | {"quantization_config": json.loads(
        (embedded_result("nvfp4") / "config.json").read_text())["quantization_config"]}))
    cli = {"g4convert": main, "g4serve": g4serve}[args[0]]
    argv = [a.format(src=src, tmp=tmp_path, out=out) for a in args[1:]]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: "), r.output
    assert "hidden_activation 'swiglu_typo'" in r.output
    assert not (tmp_path / "o").exists()


def test_gemma4s_activation_is_one_transformers_computes():
    """read_architecture takes HIDDEN_ACTIVATION without importing transformers (the conversion's
    start): it must be one transformers' ACT2CLS has, and the one transformers' Gemma 4 config uses."""
    from transformers import Gemma4TextConfig
    from transformers.activations import ACT2CLS

    from g4.core.gemma4 import HIDDEN_ACTIVATION

    assert HIDDEN_ACTIVATION in ACT2CLS
    assert Gemma4TextConfig().hidden_activation == HIDDEN_ACTIVATION


_one_error_line = one_error_line


@pytest.mark.parametrize("args", [
    ["g4convert", "nvfp4", "", "{tmp}/o"], ["g4convert", "int8-neuron", " ", "{tmp}/o"], ["g4convert", "plan", ""],
    ["g4convert", "verify", "{out}", "--against", ""], ["g4convert", "eval", "{out}", "--against", ""],
    ["g4serve", "check", "{out}", "--against", ""],
], ids=lambda a: " ".join(a[:2]))
def test_an_empty_src_says_so_on_every_command(tmp_path, args):
    """Fresh-user finding: SRC "" was the working directory, reported as `config.json: missing`."""
    from serve_fixtures import embedded_result

    from g4.serve.cli import main as g4serve

    cli = {"g4convert": main, "g4serve": g4serve}[args[0]]
    argv = [a.format(tmp=tmp_path, out=embedded_result("nvfp4")) for a in args[1:]]
    line = _one_error_line(CliRunner().invoke(cli, argv), "SRC is empty", "'embedded'")
    assert "config.json" not in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args", [
    ["nvfp4", "embedded", "{parent}/o", "--weight-only"], ["int8-neuron", "embedded", "{parent}/o", "--tp", "1"],
    ["synth", "{parent}/o", "--layers", "1"],
], ids=lambda a: a[0])
@pytest.mark.parametrize("how", ["permissions", "mkdir fails"])
def test_an_out_parent_that_is_not_writable_is_named_not_the_temporary_directory(tmp_path, monkeypatch, args, how):
    """Fresh-user finding: a read-only OUT parent named `.o.partial-<pid>-<hex>: Permission denied`.
    Both ways it shows: os.access says so (a user without write permission), or creating the
    temporary directory fails although os.access passed (root on a read-only mount, ACLs)."""
    import os
    from pathlib import Path

    parent = tmp_path / "ro"
    parent.mkdir()
    if how == "permissions":
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == parent else real_access(p, mode, **kw))
    else:
        real_mkdir = Path.mkdir

        def mkdir(self, *a, **kw):
            if self.parent == parent:
                raise PermissionError(13, "Permission denied", str(self))
            return real_mkdir(self, *a, **kw)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    r = CliRunner().invoke(main, [a.format(parent=parent) for a in args])
    line = _one_error_line(r, f"{parent}: the parent directory of OUT is not writable")
    assert ".partial" not in line
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("args", [
    ["g4convert", "nvfp4", "embedded", "{tmp}/o", "--calib-data", "{csv}"],
    ["g4convert", "eval", "{out}", "--text", "{csv}"],
    ["g4serve", "check", "{out}", "--against", "embedded", "--prompts", "{csv}"],
], ids=lambda a: a[-2])
def test_a_text_file_of_another_kind_is_refused_not_read_as_plain_text(tmp_path, args):
    """Fresh-user finding: --calib-data x.csv was read as plain text without a word."""
    from serve_fixtures import embedded_result

    from g4.serve.cli import main as g4serve

    csv = tmp_path / "x.csv"
    csv.write_text("question,answer\nWhat is the capital of France?,Paris\n")
    cli = {"g4convert": main, "g4serve": g4serve}[args[0]]
    argv = [a.format(tmp=tmp_path, out=embedded_result("nvfp4"), csv=csv) for a in args[1:]]
    _one_error_line(CliRunner().invoke(cli, argv), f"{csv}: {args[-2]} takes .txt (", ".jsonl (", "not .csv")
    assert not (tmp_path / "o").exists()
