"""g4 reads only what SRC holds, as real values: shard names inside SRC (checked = hashed =
read), Hub-cache symlinks followed, quantized or integer-coded sources refused up front."""

import hashlib
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from helpers import g4convert, one_error_line

from g4.serve.cli import main as g4serve

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
FP8_TENSOR = "model.language_model.layers.0.experts.down_proj"
INT8_TENSOR = "model.language_model.layers.1.mlp.down_proj.weight"


run = g4convert


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sharded(src, dst):
    """``src`` re-saved as two shards with an index (safetensors' own writer)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    sd = load_file(src / "model.safetensors")
    names = sorted(sd)
    parts = dict(zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2:])))
    for file, members in parts.items():
        save_file({n: sd[n] for n in members}, dst / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in sd.values())},
             "weight_map": {n: f for f, members in parts.items() for n in members}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def rename_shard(root, old, new):
    p = root / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    index["weight_map"] = {n: (new if f == old else f) for n, f in index["weight_map"].items()}
    p.write_text(json.dumps(index))


def zeroed_copy(path, dst):
    """A decoy: same header as ``path``, every value zero."""
    save_file({n: torch.zeros_like(t) for n, t in load_file(path).items()}, dst, metadata={"format": "pt"})


def rank_tensors(out):
    return [load_file(out / "weights" / f"tp{r}_sharded_checkpoint.safetensors") for r in range(2)]


def assert_same_ranks(a, b):
    for ra, rb in zip(rank_tensors(a), rank_tensors(b)):
        assert ra.keys() == rb.keys()
        for n in ra:
            assert torch.equal(ra[n], rb[n]), n


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory, tiny_mm):
    return sharded(tiny_mm, tmp_path_factory.mktemp("two") / "src")


@pytest.fixture(scope="module")
def two_shards_int8(tmp_path_factory, two_shards):
    out = tmp_path_factory.mktemp("two_out") / "out"
    r = run("int8-neuron", two_shards, out, "--tp", "2")
    assert r.exit_code == 0, r.output
    return out


# --------------------------------------------------------------------------- item 2: shard names


@pytest.mark.parametrize("how", ["absolute", "dotdot", "dotdot-inside"])
def test_index_naming_a_shard_outside_src_is_refused(two_shards, tmp_path, how):
    src = shutil.copytree(two_shards, tmp_path / "src")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(src / SHARDS[1], outside / SHARDS[1])
    zeroed_copy(outside / SHARDS[1], src / SHARDS[1])  # a decoy where the bare name would land
    name = {"absolute": str(outside / SHARDS[1]), "dotdot": f"../elsewhere/{SHARDS[1]}",
            "dotdot-inside": f"sub/../../elsewhere/{SHARDS[1]}"}[how]
    (src / "sub").mkdir()
    rename_shard(src, SHARDS[1], name)
    index = src / "model.safetensors.index.json"
    for args in (["int8-neuron", src, tmp_path / "o1", "--tp", "2"],
                 ["nvfp4", src, tmp_path / "o2", "--weight-only"],
                 ["plan", src, "--format", "nvfp4"]):
        r = run(*args)
        one_error_line(r, f"{index}: names shard {name}", "absolute path" if how == "absolute" else "'..'")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()



def test_index_naming_a_shard_that_is_not_safetensors_is_refused(two_shards, tmp_path):
    """An index entry such as ``pytorch_model.bin`` is refused by name, before any file is opened
    (and a Hub download never fetches it): g4 reads safetensors only."""
    src = shutil.copytree(two_shards, tmp_path / "src")
    shutil.copy(src / SHARDS[1], src / "pytorch_model.bin")
    rename_shard(src, SHARDS[1], "pytorch_model.bin")
    r = run("nvfp4", src, tmp_path / "o", "--weight-only")
    one_error_line(r, "names shard 'pytorch_model.bin', which is not a .safetensors file")
    assert not (tmp_path / "o").exists()

def test_shard_in_a_subfolder_is_read_hashed_and_checked_as_one_file(two_shards, two_shards_int8, tmp_path):
    src = shutil.copytree(two_shards, tmp_path / "src")
    (src / "sub").mkdir()
    shutil.move(src / SHARDS[1], src / "sub" / SHARDS[1])
    zeroed_copy(src / "sub" / SHARDS[1], src / SHARDS[1])  # the bare name must not be what is read
    rename_shard(src, SHARDS[1], f"sub/{SHARDS[1]}")
    out = tmp_path / "out"
    r = run("int8-neuron", src, out, "--tp", "2")
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["files"] == {SHARDS[0]: sha256(src / SHARDS[0]),
                                           f"sub/{SHARDS[1]}": sha256(src / "sub" / SHARDS[1])}
    assert_same_ranks(out, two_shards_int8)
    card = json.loads((out / "g4_conversion.json").read_text())["source"]
    assert card["weight_files"] == [SHARDS[0], f"sub/{SHARDS[1]}"]
    assert card["weight_bytes"] == (src / SHARDS[0]).stat().st_size + (src / "sub" / SHARDS[1]).stat().st_size


def test_hub_cache_snapshot_of_symlinks_to_blobs_converts(two_shards, two_shards_int8, tmp_path):
    """The Hub cache layout: snapshots/<rev>/<file> -> ../../blobs/<sha256>, blobs outside SRC."""
    repo = tmp_path / "models--google--gemma-4-tiny"
    (repo / "blobs").mkdir(parents=True)
    src = repo / "snapshots" / "0123abcd"
    src.mkdir(parents=True)
    for f in sorted(two_shards.iterdir()):
        digest = sha256(f)
        shutil.copy2(f, repo / "blobs" / digest)
        os.symlink(f"../../blobs/{digest}", src / f.name)
    out = tmp_path / "out"
    r = run("int8-neuron", src, out, "--tp", "2")
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["files"] == {f: sha256(two_shards / f) for f in SHARDS}
    assert_same_ranks(out, two_shards_int8)
    assert run("plan", src, "--format", "nvfp4").exit_code == 0


# --------------------------------------------------------------------------- item 3: dtypes, quantized sources


def retyped(tiny_mm, dst, name, dtype):
    src = shutil.copytree(tiny_mm, dst)
    sd = load_file(src / "model.safetensors")
    t = sd[name].float()
    sd[name] = (t / t.abs().max() * 127).round().to(dtype) if dtype in (torch.int8, torch.uint8) else t.to(dtype)
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("name,dtype,st", [(FP8_TENSOR, torch.float8_e4m3fn, "F8_E4M3"),
                                           (FP8_TENSOR, torch.float8_e5m2, "F8_E5M2"),
                                           (INT8_TENSOR, torch.int8, "I8"),
                                           (INT8_TENSOR, torch.uint8, "U8")])
def test_source_tensor_of_a_non_value_dtype_is_refused(tiny_mm, tmp_path, name, dtype, st):
    src = retyped(tiny_mm, tmp_path / "src", name, dtype)
    says = f"{src / 'model.safetensors'}: tensor {name} is stored as {st}"
    for args in (["nvfp4", src, tmp_path / "o1", "--weight-only"],
                 ["int8-neuron", src, tmp_path / "o2", "--tp", "2"],
                 ["plan", src, "--format", "int8-neuron", "--tp", "2"]):
        one_error_line(run(*args), says, "BF16/F16/F32")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("where", ["config", "text_config", "hf_quant_config", "empty", "vision_config",
                                   "compression_config"])
def test_already_quantized_source_is_refused(tiny_mm, tmp_path, where):
    src = shutil.copytree(tiny_mm, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    if where == "config":
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        says = [f"{src / 'config.json'}: quantization_config (quant_method 'fp8')"]
    elif where == "text_config":
        config["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors"}
        says = [f"{src / 'config.json'}: text_config.quantization_config (quant_method 'compressed-tensors')"]
    elif where == "empty":  # present but empty still says the weights are not plain values
        config["quantization_config"] = {}
        says = [f"{src / 'config.json'}: quantization_config"]
    elif where == "vision_config":
        config["vision_config"]["quantization_config"] = {"quant_method": "bitsandbytes"}
        says = [f"{src / 'config.json'}: vision_config.quantization_config (quant_method 'bitsandbytes')"]
    elif where == "compression_config":  # compressed-tensors' older key
        config["compression_config"] = {"quant_method": "sparseml"}
        says = [f"{src / 'config.json'}: compression_config (quant_method 'sparseml')"]
    else:
        (src / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
        says = [f"{src / 'hf_quant_config.json'}: present (quant_algo 'FP8')"]
    (src / "config.json").write_text(json.dumps(config))
    for args in (["nvfp4", src, tmp_path / "o1", "--weight-only"],
                 ["int8-neuron", src, tmp_path / "o2", "--tp", "2"],
                 ["plan", src, "--format", "int8-neuron", "--tp", "2"]):
        one_error_line(run(*args), *says, "already quantized")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.fixture(scope="module")
def tiny_w4a16(tmp_path_factory, tiny_mm):
    out = tmp_path_factory.mktemp("w4a16") / "out"
    assert run("nvfp4", tiny_mm, out, "--weight-only").exit_code == 0
    return out


def test_verify_and_check_refuse_the_same_sources(tiny_mm, tiny_w4a16, tmp_path):
    src = retyped(tiny_mm, tmp_path / "src", FP8_TENSOR, torch.float8_e4m3fn)
    says = f"{src / 'model.safetensors'}: tensor {FP8_TENSOR} is stored as F8_E4M3"
    one_error_line(run("verify", tiny_w4a16, "--against", src), says)
    r = CliRunner().invoke(g4serve, ["check", str(tiny_w4a16), "--against", str(src)])
    one_error_line(r, says)
    assert not (tiny_w4a16 / "verification.json").exists()
    quant = shutil.copytree(tiny_mm, tmp_path / "quant")
    (quant / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    r = CliRunner().invoke(g4serve, ["check", str(tiny_w4a16), "--against", str(quant)])
    one_error_line(r, f"{quant / 'hf_quant_config.json'}: present (quant_algo 'FP8')", "already quantized")


@pytest.mark.parametrize("file, text, says", [
    ("generation_config.json", "{", "invalid JSON"),
    ("tokenizer_config.json", "[]", "invalid JSON (not an object)"),
    ("chat_template.jinja", "{% for m in messages %}{{ m.content }", "invalid chat template (line 1"),
])
def test_a_broken_side_file_stops_the_conversion_up_front(tiny_mm, tmp_path, file, text, says):
    """A side file that travels into OUT must be readable by whatever loads OUT; before, a broken
    generation_config.json converted with exit 0 and g4serve OUT died with a traceback."""
    src = shutil.copytree(tiny_mm, tmp_path / "src")
    (src / file).write_text(text)
    for args in (["nvfp4", src, tmp_path / "o1", "--weight-only"], ["int8-neuron", src, tmp_path / "o2", "--tp", "1"]):
        one_error_line(run(*args), f"{src / file}: {says}")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_unreadable_config_and_non_file_shards_name_the_file(tiny_mm, tmp_path):
    """A config.json that is not UTF-8 was a traceback; a shard that is a device or folder was
    said not to exist."""
    src = shutil.copytree(tiny_mm, tmp_path / "src")
    (src / "config.json").write_bytes(b"\xff\xfe{}")
    one_error_line(run("nvfp4", src, tmp_path / "o", "--weight-only"), f"{src / 'config.json'}: invalid JSON")
    shutil.copy(tiny_mm / "config.json", src / "config.json")
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to("/dev/zero")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    one_error_line(run("nvfp4", src, tmp_path / "o", "--weight-only"),
                   "names shard model.safetensors, which is not a regular file")
    assert not (tmp_path / "o").exists()


def test_an_embedding_that_disagrees_with_vocab_size_is_refused(tiny_mm, tmp_path):
    """vocab_size 10**12 with a 1024-row embedding converted with exit 0, and g4serve OUT then
    tried to allocate 512 TB."""
    src = shutil.copytree(tiny_mm, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["vocab_size"] = 10**12
    (src / "config.json").write_text(json.dumps(config))
    for args in (["nvfp4", src, tmp_path / "o1", "--weight-only"],
                 ["int8-neuron", src, tmp_path / "o2", "--tp", "1", "--force"]):  # past the 68 TB memory plan
        one_error_line(run(*args), "embed_tokens.weight: [1024, ", "vocab_size 1000000000000")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("change, says", [
    (lambda c: c["text_config"].update(top_k_experts=100), "top_k_experts 100 is more than num_experts"),
    (lambda c: c["text_config"].update(layer_types=["foo"] * c["text_config"]["num_hidden_layers"]),
     "layer_types has 'foo'"),
    (lambda c: c["text_config"].update(tie_word_embeddings="no"), "tie_word_embeddings is 'no', expected true or false"),
    (lambda c: (c.update(tie_word_embeddings=True), c["text_config"].update(tie_word_embeddings=False)),
     "tie_word_embeddings is true at the top level but false at text_config"),
], ids=["top_k", "layer_types", "tie_type", "tie_levels"])
def test_config_values_a_server_cannot_run_are_refused_at_conversion(tiny_mm, tmp_path, change, says):
    """Each converted with exit 0 and failed later in g4serve (a traceback, 500s, or a message
    blaming the tokenizer)."""
    src = shutil.copytree(tiny_mm, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    change(config)
    (src / "config.json").write_text(json.dumps(config))
    for args in (["nvfp4", src, tmp_path / "o1", "--weight-only"], ["int8-neuron", src, tmp_path / "o2", "--tp", "1"]):
        one_error_line(run(*args), f"{src / 'config.json'}", says)
    one_error_line(run("plan", src / "config.json", "--format", "nvfp4"), says)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_deferred_template_check_raises_when_waited_for(tiny_mm, tmp_path):
    """A conversion without calibration compiles the chat template in the background while its
    first layer is read (Checkpoint(defer_template_check=True)); the error comes when it waits."""
    from g4.core.checkpoint import Checkpoint
    from g4.core.errors import CheckpointError

    src = shutil.copytree(tiny_mm, tmp_path / "src")
    (src / "chat_template.jinja").write_text("{% if x %}")
    ckpt = Checkpoint(src, source=True, defer_template_check=True)  # the JSON checks only, here
    with pytest.raises(CheckpointError, match="invalid chat template"):
        ckpt.side_files_checked()
    with pytest.raises(CheckpointError, match="invalid chat template"):
        Checkpoint(src, source=True)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    Checkpoint(src, source=True, defer_template_check=True).side_files_checked()
