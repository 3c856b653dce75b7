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
