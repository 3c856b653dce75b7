"""Only typed g4 errors become one-line ``error:`` messages; a broken internal invariant
(any other exception, a bare ValueError included) stays a traceback."""

import pytest
from click.testing import CliRunner

import g4.convert.nvfp4
from g4.convert.cli import main
from g4.convert.errors import OptionError


def test_internal_value_error_is_not_turned_into_a_user_error(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise ValueError("internal invariant broken")

    monkeypatch.setattr(g4.convert.nvfp4, "convert_nvfp4", broken)
    r = CliRunner().invoke(main, ["nvfp4", "embedded", str(tmp_path / "out")])
    assert isinstance(r.exception, ValueError) and not isinstance(r.exception, SystemExit)
    assert "error: internal invariant broken" not in r.output


def test_a_bad_size_is_a_typed_option_error():
    from g4.exporters.safetensors_writer import parse_size

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

    from test_serve_fixtures import embedded_result

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
