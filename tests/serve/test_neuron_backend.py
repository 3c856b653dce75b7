"""The neuron backend's host-side rules (``g4/serve/neuron_backend.py``, ``Manifest.serving_shape``):
the serving length and bucket ladders in ``manifest.json`` (with the defaults older results get),
the NxDI settings built from them, and the compiled folder's reuse / recompile / refusal rules.
The engine itself runs through NxDI in ``tests/lanes/test_nxdi_gemma4.py``; compiling for Neuron needs
inf2 and is not run here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from g4.core.errors import CheckpointError, G4Error
from g4.exporters.neuron_int8 import DEFAULT_MAX_LENGTH, Manifest, neuron_buckets
from g4.serve import neuron_backend as nb


@pytest.fixture(scope="module")
def int8_out(tmp_path_factory):
    from g4.convert.int8_neuron import convert_int8_neuron
    from g4.convert.resolve import EMBEDDED_DIR

    return convert_int8_neuron(EMBEDDED_DIR, tmp_path_factory.mktemp("nb") / "int8", tp=1, target="inf2.xlarge",
                               progress=False, seq_len=300).out


def test_neuron_buckets_follow_nxdi_autobucketing():
    assert neuron_buckets(8192) == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert neuron_buckets(3000) == [128, 256, 512, 1024, 2048, 3000]
    assert neuron_buckets(300) == [128, 300] and neuron_buckets(400) == [128, 256, 400]
    assert neuron_buckets(150) == [150] and neuron_buckets(32) == [32]


def test_conversion_writes_the_serving_shape_and_plans_for_it(int8_out):
    raw = json.loads((int8_out / "manifest.json").read_text())
    assert raw["max_length"] == 300
    assert raw["context_encoding_buckets"] == raw["token_generation_buckets"] == [128, 300]
    assert raw["memory_plan"]["inputs"]["seq_len"] == 300
    assert Manifest.from_dir(int8_out).serving_shape(2048) == (300, [128, 300], [128, 300])


def test_an_older_manifest_gets_its_plans_length_capped_at_the_model(int8_out, tmp_path):
    old = shutil.copytree(int8_out, tmp_path / "old")
    raw = json.loads((old / "manifest.json").read_text())
    for key in ("max_length", "context_encoding_buckets", "token_generation_buckets", "max_context_length"):
        del raw[key]
    raw["memory_plan"]["inputs"]["seq_len"] = 8192
    (old / "manifest.json").write_text(json.dumps(raw))
    m = Manifest.from_dir(old)
    assert m.max_length is None
    assert m.serving_shape(2048) == (2048, neuron_buckets(2048), neuron_buckets(2048))
    raw["memory_plan"] = None
    (old / "manifest.json").write_text(json.dumps(raw))
    assert Manifest.from_dir(old).serving_shape(None)[0] == DEFAULT_MAX_LENGTH


@pytest.mark.parametrize("field,value", [("max_length", 0), ("context_encoding_buckets", [300, 128]),
                                         ("token_generation_buckets", [128, 256]), ("max_length", "300"),
                                         ("context_encoding_buckets", [128, 256]), ("max_context_length", 0),
                                         ("max_context_length", 256)])
def test_a_bad_serving_shape_is_refused(int8_out, tmp_path, field, value):
    bad = shutil.copytree(int8_out, tmp_path / "bad")
    raw = json.loads((bad / "manifest.json").read_text())
    raw[field] = value
    (bad / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=field if field == "token_generation_buckets" else "max_length|buckets|max_context_length"):
        Manifest.from_dir(bad).serving_shape(2048)


def test_prompts_longer_than_the_kv_cache_share_is_another_context_encoding_ladder(tmp_path):
    """``--seq-len 1500 --max-context-length 200``: the manifest's context-encoding ladder stops at the
    longest prompt (NxDI's max_context_length), token generation's at the KV cache length; the NxDI
    settings and the plan recorded in it follow; a longest prompt past --seq-len is one error line."""
    from g4.convert.cli import main

    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["int8-neuron", "embedded", str(out), "--tp", "1", "--seq-len", "1500",
                                  "--max-context-length", "200", "-q"])
    assert r.exit_code == 0, r.output
    m = Manifest.from_dir(out)
    assert (m.max_length, m.max_context_length) == (1500, 200)
    assert m.serving_shape(2048) == (1500, [128, 200], [128, 256, 512, 1024, 1500])
    neuron = nb.nxdi_settings(m, json.loads((out / "config.json").read_text()), on_cpu=False, dtype="bfloat16")
    assert (neuron["seq_len"], neuron["max_length"], neuron["max_context_length"]) == (1500, 1500, 200)
    assert neuron["context_encoding_buckets"] == [128, 200]
    assert neuron["token_generation_buckets"] == [128, 256, 512, 1024, 1500]
    cpu = nb.nxdi_settings(m, json.loads((out / "config.json").read_text()), on_cpu=True, dtype="float32")
    assert (cpu["seq_len"], cpu["max_context_length"]) == (1500, 200)
    plan = m.memory_plan
    assert plan["inputs"]["max_context_length"] == 200
    assert plan["buckets"]["context_encoding"] == [128, 200]
    assert plan["context_encoding_attention"] == 4 * 200 * 200 * (4 + 2)  # 4 query heads, TP 1
    r = CliRunner().invoke(main, ["int8-neuron", "embedded", str(tmp_path / "p"), "--tp", "1", "--seq-len", "100",
                                  "--max-context-length", "200"])
    assert r.exit_code == 2 and "error: --max-context-length 200: a prompt can be 1 to 100 tokens" in r.output
    assert not (tmp_path / "p").exists()
    # planned as the result it is: its longest prompt is fixed
    from g4.convert.cli import plan as plan_cmd

    r = CliRunner().invoke(plan_cmd, [str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["inputs"]["max_context_length"] == 200
    r = CliRunner().invoke(plan_cmd, [str(out), "--max-context-length", "100"])
    assert r.exit_code == 2 and "pass --max-context-length 200" in r.output


def test_the_default_longest_prompt_is_4096_within_the_kv_cache(int8_out, tmp_path):
    from g4.exporters.neuron_int8 import DEFAULT_MAX_CONTEXT_LENGTH, serving_max_context_length

    assert DEFAULT_MAX_CONTEXT_LENGTH == 4096
    assert serving_max_context_length(None, 8192) == 4096 and serving_max_context_length(None, 300) == 300
    assert Manifest.from_dir(int8_out).max_context_length == 300
    with pytest.raises(G4Error, match="--max-context-length 0"):
        serving_max_context_length(0, 300)


def test_seq_len_beyond_the_model_is_a_usage_error(tmp_path):
    from g4.convert.cli import main

    r = CliRunner().invoke(main, ["int8-neuron", "embedded", str(tmp_path / "o"), "--tp", "1", "--seq-len", "4096"])
    assert r.exit_code == 2 and "error: --seq-len 4096: the model takes 1 to 2048 tokens" in r.output
    assert not (tmp_path / "o").exists()


def test_nxdi_settings_on_neuron_and_on_cpu(int8_out):
    m, config = Manifest.from_dir(int8_out), json.loads((int8_out / "config.json").read_text())
    neuron = nb.nxdi_settings(m, config, on_cpu=False, dtype="bfloat16")
    assert neuron["seq_len"] == neuron["max_length"] == neuron["max_context_length"] == 300
    assert neuron["enable_bucketing"] and neuron["context_encoding_buckets"] == [128, 300]
    assert neuron["tp_degree"] == 1 and neuron["quantized"]
    cpu = nb.nxdi_settings(m, config, on_cpu=True, dtype="float32")
    assert cpu["on_cpu"] and "context_encoding_buckets" not in cpu and cpu["max_context_length"] == 300
    assert neuron["batch_size"] == 1 and "is_continuous_batching" not in neuron  # B=1: earlier compiles stay current


def test_nxdi_settings_for_several_requests_at_once_are_continuous_batching(int8_out):
    """``--max-batch-size 4``: NxDI's continuous batching (4 KV cache lines, context encoding one
    request at a time, token generation for 4 rows); another batch size is another compile."""
    m, config = Manifest.from_dir(int8_out), json.loads((int8_out / "config.json").read_text())
    one = nb.nxdi_settings(m, config, on_cpu=False, dtype="bfloat16")
    four = nb.nxdi_settings(m, config, on_cpu=False, dtype="bfloat16", max_batch_size=4)
    assert four == dict(one, batch_size=4, max_batch_size=4, tkg_batch_size=4, ctx_batch_size=1,
                        is_continuous_batching=True)
    assert nb.compile_stamp(int8_out, four) != nb.compile_stamp(int8_out, one)
    with pytest.raises(G4Error, match="--max-batch-size must be at least 1"):
        nb.nxdi_settings(m, config, on_cpu=False, dtype="bfloat16", max_batch_size=0)


class _Compiles:
    """What g4's compile step needs of NxDI's model object: ``compile(path)`` writing ``model.pt``
    (counted), as ``NeuronApplicationBase.compile`` does."""

    def __init__(self):
        self.calls = 0

    def compile(self, path):
        self.calls += 1
        (Path(path) / nb.COMPILED_MODEL).write_bytes(b"compiled")


def test_the_compiled_folder_is_reused_recompiled_when_stale_and_never_taken_when_foreign(int8_out, tmp_path):
    compiled = tmp_path / "compiled"
    settings = nb.nxdi_settings(Manifest.from_dir(int8_out), json.loads((int8_out / "config.json").read_text()),
                                on_cpu=False, dtype="bfloat16")
    stamp = nb.compile_stamp(int8_out, settings)
    assert nb.compiled_state(compiled, stamp) == "absent"
    model = _Compiles()
    nb._compile(model, compiled, stamp, replace=False)
    assert nb.compiled_state(compiled, stamp) == "current" and model.calls == 1
    assert not list(tmp_path.glob(".compiled.partial*"))
    # other settings, or another result's manifest: stale, compiled again in place
    assert nb.compiled_state(compiled, nb.compile_stamp(int8_out, dict(settings, tp_degree=2))) == "stale"
    other = shutil.copytree(int8_out, tmp_path / "other")
    raw = json.loads((other / "manifest.json").read_text())
    raw["source"]["files"] = {"model.safetensors": "0" * 64}
    (other / "manifest.json").write_text(json.dumps(raw))
    other_stamp = nb.compile_stamp(other, settings)
    assert other_stamp["sha256"] != stamp["sha256"] and nb.compiled_state(compiled, other_stamp) == "stale"
    nb._compile(model, compiled, other_stamp, replace=True)
    assert nb.compiled_state(compiled, other_stamp) == "current" and nb.compiled_state(compiled, stamp) == "stale"
    # a folder g4 did not write is refused, not deleted
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(G4Error, match="not a g4 compiled folder"):
        nb.compiled_state(foreign, stamp)
    assert (foreign / "notes.txt").is_file()


def test_a_failed_compile_leaves_nothing(int8_out, tmp_path):
    class Fails:
        def compile(self, path):
            (Path(path) / "half").write_text("x")
            raise RuntimeError("neuronx-cc failed")

    with pytest.raises(RuntimeError):
        nb._compile(Fails(), tmp_path / "compiled", {"sha256": "x", "settings": {}}, replace=False)
    assert list(tmp_path.iterdir()) == []


def test_g4serve_neuron_without_neuron_is_one_error_line(int8_out):
    from g4.serve.cli import main

    r = CliRunner().invoke(main, [str(int8_out), "--backend", "neuron"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1].startswith("error: backend neuron unavailable: ")
    r = CliRunner().invoke(main, [str(int8_out), "--backend", "cpu", "--compiled-dir", str(int8_out / "c")])
    assert r.exit_code == 2 and "error: --compiled-dir is a neuron backend option" in r.output
    r = CliRunner().invoke(main, [str(int8_out), "--backend", "cpu", "--max-batch-size", "2"])
    assert r.exit_code == 2 and "error: --max-batch-size is a neuron backend option" in r.output, r.output
    r = CliRunner().invoke(main, [str(int8_out), "--max-batch-size", "0"])
    assert r.exit_code == 2 and "--max-batch-size" in r.output, r.output


def test_load_neuron_engine_refuses_without_neuron(int8_out):
    with pytest.raises(G4Error, match="neuron backend unavailable"):
        nb.load_neuron_engine(int8_out)


def test_g4serve_compile_writes_the_folder_serving_reuses(int8_out, tmp_path, monkeypatch):
    """``g4serve compile OUT --compiled-dir DIR``: NxDI's ``compile`` (here a stand-in model: the
    Neuron SDK is not installed) with exactly the settings the neuron backend loads with, so the
    serving path finds DIR ``current`` and would not compile again; a second run compiles nothing;
    no Neuron SDK, or a result that is not int8-neuron, is one ``error:`` line."""
    from g4.serve.cli import main

    r = CliRunner().invoke(main, ["compile", str(int8_out), "--compiled-dir", str(tmp_path / "c")])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith(
        "error: cannot compile for Neuron here: ") and not (tmp_path / "c").exists(), r.output
    models, asked = [], []

    def build(path, settings):
        asked.append(settings)
        models.append(_Compiles())
        return models[-1]

    monkeypatch.setattr(nb, "neuron_status", lambda need_device=True: (not need_device, "no NeuronCore device"))
    monkeypatch.setattr(nb, "build_nxdi_model", build)
    r = CliRunner().invoke(main, ["compile", str(int8_out), "--compiled-dir", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    assert "compiling for Neuron into" in r.output and "copy that folder to the serving box" in r.output
    serving = nb._result_settings(int8_out, on_cpu=False)
    assert asked == [serving] and models[0].calls == 1
    assert nb.compiled_state(tmp_path / "c", nb.compile_stamp(int8_out, serving)) == "current"
    r = CliRunner().invoke(main, ["compile", str(int8_out), "--compiled-dir", str(tmp_path / "c")])
    assert r.exit_code == 0 and "nothing to do" in r.output and len(models) == 1, r.output
    # the serving start on a Neuron box (NeuronCores present): loads the folder, compiles nothing
    monkeypatch.setattr(nb, "neuron_status", lambda need_device=True: (True, "NeuronCores present"))

    class Loads(_Compiles):
        def load(self, path):
            self.loaded = path

    monkeypatch.setattr(nb, "build_nxdi_model", lambda path, settings: models.append(Loads()) or models[-1])
    lines = []
    engine = nb.load_neuron_engine(int8_out, compiled_dir=tmp_path / "c", log=lines.append)
    assert engine.model is models[-1] and models[-1].calls == 0 and models[-1].loaded == str(tmp_path / "c")
    assert lines == [f"loading the compiled model from {tmp_path / 'c'}"], lines
    # a result the class cannot load is refused before the compile, not after it on the serving box
    from g4.convert.int8_neuron import convert_int8_neuron
    from g4.convert.resolve import EMBEDDED_DIR

    qa = convert_int8_neuron(EMBEDDED_DIR, tmp_path / "qa", tp=1, quantize_attention=True, target=None,
                             progress=False, seq_len=64).out
    assert Manifest.from_dir(qa).quantize_attention
    r = CliRunner().invoke(main, ["compile", str(qa)])
    assert r.exit_code == 2 and "int8 attention (--quantize-attention)" in r.output and not (qa / "neuron_compiled").exists()
    nvfp4 = tmp_path / "nvfp4"
    nvfp4.mkdir()
    r = CliRunner().invoke(main, ["compile", str(_nvfp4_result(nvfp4))])
    assert r.exit_code == 2 and "g4serve compile takes an int8-neuron result" in r.output, r.output


def _nvfp4_result(out: Path) -> Path:
    """A W4A16 NVFP4 result of the embedded model (no calibration: fast)."""
    from g4.convert.nvfp4 import convert_nvfp4
    from g4.convert.resolve import EMBEDDED_DIR

    return convert_nvfp4(EMBEDDED_DIR, out / "r", weight_only=True, progress=False).out


def test_a_compile_inside_out_is_never_pushed(int8_out, tmp_path):
    """OUT/neuron_compiled (g4serve compile's default) holds NxDI's neuron_config.json with this
    machine's paths and a machine-specific graph: not a file of the Hub repo, wherever in OUT it is."""
    from g4.convert.card import repo_files

    out = shutil.copytree(int8_out, tmp_path / "out")
    before = repo_files(out)
    for folder in (out / nb.COMPILED_DIR, out / "elsewhere"):
        folder.mkdir()
        (folder / nb.COMPILED_STAMP).write_text("{}")
        (folder / "neuron_config.json").write_text(json.dumps({"quantized_checkpoints_path": str(out)}))
        (folder / nb.COMPILED_MODEL).write_bytes(b"graph")
    (out / "notes").mkdir()
    (out / "notes" / "neuron_config.json").write_text("{}")  # not a compile: still the user's file, pushed
    assert repo_files(out) == sorted(before + [("notes/neuron_config.json", 2)])
