"""Nothing that can be pushed to the Hub records a local path (fresh-user findings, item 2): the
files g4 writes into OUT (model card, g4_conversion.json, verification.json, and the manifest for
int8-neuron) name the source by what identifies it (``embedded``, repo id and commit, or the
directory's name), never by where it lies on this machine."""

import json
import shutil

from click.testing import CliRunner

from g4.convert.cli import main as g4convert
from g4.convert.embedded_model import EMBEDDED_DIR
from g4.serve.cli import main as g4serve


def test_a_source_given_by_absolute_path_leaves_no_path_in_out(tmp_path):
    src = tmp_path / "private" / "my-gemma"
    shutil.copytree(EMBEDDED_DIR, src)
    out = tmp_path / "private" / "result"
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is the capital of France?\n")
    r = CliRunner().invoke(g4convert, ["-q", "nvfp4", str(src.resolve()), str(out), "--weight-only"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(g4serve, ["check", str(out), "--against", str(src.resolve()), "--prompts", str(prompts),
                                     "--max-tokens", "4", "--chat-max-tokens", "8", "--min-agreement", "0"],
                           catch_exceptions=False)
    assert (out / "verification.json").is_file(), r.output
    assert json.loads((out / "verification.json").read_text())["source"] == "my-gemma"
    assert json.loads((out / "g4_conversion.json").read_text())["source"]["name"] == "my-gemma"
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".md", ".jinja", ".txt")):
        text = f.read_text()
        assert str(tmp_path) not in text and "/private/" not in text, f"{f.name} records a local path"


def test_an_int8_neuron_result_of_a_local_source_records_no_path(tmp_path):
    src = tmp_path / "private" / "my-gemma"
    shutil.copytree(EMBEDDED_DIR, src)
    out = tmp_path / "private" / "int8"
    r = CliRunner().invoke(g4convert, ["-q", "int8-neuron", str(src.resolve()), str(out), "--tp", "2"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".md", ".jinja", ".txt")):
        assert str(tmp_path) not in f.read_text(), f"{f.name} records a local path"
