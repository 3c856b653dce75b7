"""Messages of a fresh-user round (issue 24, item 6) that are not one command's: sizes printed in
a unit that shows them, the indefinite article before a name, summaries of conversions without
calibration, and -q / -v before or after the subcommand of both console scripts."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import run_module

from g4.core.errors import a_or_an
from g4.convert.int8_neuron import Int8Report
from g4.convert.nvfp4 import ConvertReport
from g4.serve.cli import main as g4serve


@pytest.mark.parametrize("word, expected", [
    ("NVFP4 result", "an NVFP4 result"), ("int8-neuron result", "an int8-neuron result"),
    ("unquantized checkpoint", "an unquantized checkpoint"), ("bf16 checkpoint", "a bf16 checkpoint"),
    ("NVFP4 W4A4 (modelopt)", "an NVFP4 W4A4 (modelopt)"), ("BF16 table", "a BF16 table"),
    ("MLP", "an MLP"), ("'image_url'", "an 'image_url'"), ("'text'", "a 'text'"),
    ("user", "a user"), ("assistant", "an assistant"), ("tool", "a tool"), ("one-line", "a one-line"),
    ("8-byte", "an 8-byte"), ("11-byte", "an 11-byte"), ("16-byte", "a 16-byte"), ("1100-byte", "a 1100-byte"),
])
def test_the_article_follows_the_sound_of_the_word(word, expected):
    assert a_or_an(word) == expected


def test_no_message_in_the_sources_puts_a_before_a_vowel_sound_name():
    """'a NVFP4' came from an f-string ("this is a {kind}"): every such article is a_or_an's now."""
    import re

    root = Path(__file__).resolve().parents[2]
    bad = [f"{p.relative_to(root)}:{n}: {line.strip()}"
           for d in ("core", "convert", "serve", "exporters", "quantizers") for p in sorted((root / d).glob("*.py"))
           for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"""[ "'(]a \{""", line) or re.search(r"\ba (NVFP4|int8|MLP|F32|F16|unquantized)\b", line)]
    assert bad == []


def test_neuron_backend_on_an_nvfp4_result_says_an_nvfp4_result(tmp_path):
    from serve_fixtures import embedded_result

    r = CliRunner().invoke(g4serve, [str(embedded_result("nvfp4")), "--backend", "neuron"])
    assert r.exit_code == 2 and "this is an NVFP4 result" in r.output, r.output


def test_summaries_print_sizes_in_a_unit_that_shows_them():
    """'host embedding 0.000 GB' for a 262 kB table, '0.003 GB -> 0.001 GB' for the embedded model."""
    i8 = Int8Report(out=Path("o"), tp=2, bytes_in=3_157_136, bytes_per_rank=[1_100_000, 1_099_000],
                    host_embed_bytes=262_144, seconds=1.0, peak_rss_bytes=2**30)
    text = i8.summary()
    assert "per-rank weights 1.100 MB, 1.099 MB;" in text and "host embedding 262.144 kB;" in text
    assert "source 3.157 MB;" in text and "0.000" not in text
    big = Int8Report(out=Path("o"), tp=1, bytes_in=51_600_000_000, bytes_per_rank=[13_982_312_120],
                     host_embed_bytes=1_476_395_008, seconds=1.0, peak_rss_bytes=2**30)
    assert "per-rank weights 13.982 GB; host embedding 1.476 GB; source 51.600 GB" in big.summary()
    nv = ConvertReport(out=Path("o"), linears_quantized=123, tensors_kept=85, params_quantized=10**6,
                       quantized_bytes=562_500, bytes_in=3_157_136, bytes_out=1_129_000, seconds=1.0,
                       peak_rss_bytes=2**30, calibration_tokens=0)
    assert "3.157 MB -> 1.129 MB (0.358x)" in nv.summary()


def test_a_weight_only_summary_says_no_calibration():
    kw = dict(out=Path("o"), linears_quantized=1, tensors_kept=1, params_quantized=16, quantized_bytes=9,
              bytes_in=32, bytes_out=9, seconds=1.0, peak_rss_bytes=2**30, layers=4)
    weight_only = ConvertReport(calibration_tokens=0, **kw).summary()
    assert weight_only.endswith("; no calibration (weight-only)") and "0 calibration tokens" not in weight_only
    calibrated = ConvertReport(calibration_tokens=8192, calibration_seconds=40.0, **kw).summary()
    assert "8192 calibration tokens; calibration 40.0 s (10.00 s per layer" in calibrated


_run = run_module


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_works_before_and_after_the_subcommand(tmp_path, where):
    """-q after the subcommand was 'No such option: -q' (g4convert) or taken for OUT (g4serve)."""
    args = ["int8-neuron", "embedded", str(tmp_path / "o"), "--tp", "1"]
    args = ["-q", *args] if where == "before" else [*args, "-q"]
    r = _run("g4.convert.cli", *args)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no progress bar, no INFO lines
    assert r.stdout.startswith(f"{tmp_path / 'o'}: TP=1;")


def test_without_quiet_the_conversion_shows_its_bar_and_log(tmp_path):
    r = _run("g4.convert.cli", "int8-neuron", "embedded", str(tmp_path / "o"), "--tp", "1")
    assert r.returncode == 0 and "int8-neuron:" in r.stderr and "layer 3:" in r.stderr, r.stderr


@pytest.mark.parametrize("args", [["-q", "{out}"], ["{out}", "-q"], ["-q", "serve", "{out}"], ["-v", "{out}"],
                                  ["{out}", "-v"]])
def test_g4serve_takes_the_flags_before_or_after_out(args):
    from serve_fixtures import embedded_result

    out = str(embedded_result("nvfp4"))
    r = CliRunner().invoke(g4serve, [a.format(out=out) for a in args] + ["--backend", "neuron"])
    assert r.exit_code == 2 and "the neuron backend serves int8-neuron results" in r.output, r.output


def test_g4serve_quiet_before_check_routes_to_check():
    r = CliRunner().invoke(g4serve, ["-q", "check", ".", "--against", ""])
    assert r.exit_code == 2 and "SRC is empty" in r.output, r.output
