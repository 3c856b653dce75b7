"""Reading and validating source checkpoints: layouts, shards, index, corrupt input."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from g4.core.checkpoint import Checkpoint, read_safetensors_header
from g4.core.errors import CheckpointError
from g4.core.sizes import parse_size
from g4.exporters.safetensors_writer import ShardedSafetensorsWriter, TensorSpec, plan_shards


def shard_copy(src, dst, max_bytes):
    """Re-save ``src`` as several shards with an index, through our writer."""
    ck = Checkpoint(src)
    specs = [TensorSpec(n, i.dtype, i.shape) for n, i in sorted(ck.tensors.items())]
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    w = ShardedSafetensorsWriter(dst, specs, max_shard_bytes=max_bytes)
    for s in specs:
        w.write(s.name, ck.get(s.name))
    w.close()
    return dst


def test_layouts_and_prefix(tiny_mm, tiny_text):
    mm, text = Checkpoint(tiny_mm), Checkpoint(tiny_text)
    assert mm.prefix == "model.language_model." and text.prefix == "model."
    assert "model.language_model.layers.1.self_attn.v_proj.weight" not in mm.tensors  # k_eq_v full layer
    assert mm.tensors["model.language_model.layers.0.experts.gate_up_proj"].shape == (4, 64, 64)
    assert "lm_head.weight" not in mm.tensors


def test_sharded_roundtrip_and_index(tiny_mm, tmp_path):
    dst = shard_copy(tiny_mm, tmp_path / "sharded", 40_000)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2
    a, b = Checkpoint(tiny_mm), Checkpoint(dst)
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in a.tensors.values())
    for name in a.tensors:
        assert torch.equal(a.get(name), b.get(name)), name


def test_get_rows_gathers_without_full_read(tiny_mm):
    ck = Checkpoint(tiny_mm)
    name = ck.prefix + "embed_tokens.weight"
    ids = torch.tensor([[5, 900, 5], [0, 2, 1023]])
    assert torch.equal(ck.get_rows(name, ids), ck.get(name)[ids])


def test_read_copies_exactly_the_stored_bytes(tiny_mm, tmp_path):
    ck = Checkpoint(tiny_mm)
    for name in ck.tensors:  # every dtype and shape of the model, 0-d scalars included
        got = ck.read(name)
        assert got.dtype == ck.tensors[name].dtype and torch.equal(got, ck.get(name)), name
    dst = shutil.copytree(tiny_mm, tmp_path / "t")
    short = Checkpoint(dst)
    name = max(short.tensors, key=lambda n: short.tensors[n].offset)  # the last tensor in the file
    (dst / "model.safetensors").write_bytes((dst / "model.safetensors").read_bytes()[:-8])  # cut after the check
    with pytest.raises(CheckpointError, match=rf"model.safetensors: cannot read tensor {name}: ends 8 bytes"):
        short.read(name)


def test_read_many_reads_every_shard_once_in_file_order(tiny_mm, tmp_path, monkeypatch):
    """read_many: the bytes of read() for tensors of several shards, given in any order, each
    shard opened once and read in file order; an unknown name is named."""
    import os

    src = shard_copy(tiny_mm, tmp_path / "sharded", 200_000)
    ck = Checkpoint(src)
    names = sorted(ck.tensors, reverse=True)
    assert len({ck.tensors[n].path for n in names}) > 1
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **kw: opened.append(str(p)) or real_open(p, *a, **kw))
    got = ck.read_many(names)
    assert sorted(opened) == sorted({str(ck.tensors[n].path) for n in names})  # each shard once
    monkeypatch.undo()
    for path in set(opened):  # within a shard, in file order
        offsets = [ck.tensors[n].offset for n in got if str(ck.tensors[n].path) == path]
        assert offsets == sorted(offsets)
    for n in names:
        assert got[n].dtype == ck.tensors[n].dtype and torch.equal(got[n], ck.get(n)), n
    with pytest.raises(CheckpointError, match="tensor nope is not in the checkpoint"):
        ck.read_many([names[0], "nope"])


def test_equals_compares_a_stored_tensor_block_by_block(tiny_mm):
    ck = Checkpoint(tiny_mm)
    name = ck.prefix + "embed_tokens.weight"
    w = ck.get(name)
    row = w.shape[1] * w.dtype.itemsize
    assert ck.equals(name, w.clone(), block_bytes=3 * row)  # many blocks, the last one short
    last = w.clone()
    last[-1, -1] = torch.nextafter(last[-1, -1], torch.tensor(float("inf"), dtype=last.dtype))
    assert not ck.equals(name, last, block_bytes=3 * row)  # one ulp in the last block
    assert not ck.equals(name, w.float()) and not ck.equals(name, w[:-1].clone())
    assert ck.equals(name, w.t().contiguous().t(), block_bytes=3 * row)  # a non-contiguous copy of the same values
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        ck.equals("nope", w)
    scalar = next(n for n, i in ck.tensors.items() if not i.shape or i.shape == (1,))
    assert ck.equals(scalar, ck.get(scalar).clone()) and not ck.equals(scalar, ck.get(scalar) + 1)


@pytest.fixture
def sharded(tiny_mm, tmp_path):
    return shard_copy(tiny_mm, tmp_path / "sharded", 40_000)


def edit_index(path, fn):
    p = path / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    fn(index["weight_map"])
    p.write_text(json.dumps(index))


def test_index_names_missing_file(sharded):
    edit_index(sharded, lambda wm: wm.__setitem__(next(iter(wm)), "model-99999-of-99999.safetensors"))
    with pytest.raises(CheckpointError, match="model-99999-of-99999.safetensors, which does not exist"):
        Checkpoint(sharded)


def test_tensor_missing_from_index(sharded):
    edit_index(sharded, lambda wm: wm.pop("model.language_model.norm.weight"))
    with pytest.raises(CheckpointError, match="model.language_model.norm.weight is not in the index"):
        Checkpoint(sharded)


def test_indexed_tensor_missing_from_file(sharded):
    edit_index(sharded, lambda wm: wm.__setitem__("model.language_model.ghost.weight", next(iter(wm.values()))))
    with pytest.raises(CheckpointError, match="ghost.weight is indexed in .* but that file does not hold it"):
        Checkpoint(sharded)


def test_truncated_shard(tiny_mm, tmp_path):
    dst = shutil.copytree(tiny_mm, tmp_path / "t")
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: file is .* bytes .*truncated"):
        Checkpoint(dst)


def test_garbage_file(tiny_mm, tmp_path):
    dst = shutil.copytree(tiny_mm, tmp_path / "g")
    (dst / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors header"):
        Checkpoint(dst)


def test_non_gemma4_config(tiny_mm, tmp_path):
    dst = shutil.copytree(tiny_mm, tmp_path / "l")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "llama"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: model_type is 'llama'"):
        Checkpoint(dst)


def test_pickle_only_directory_is_refused(tmp_path, tiny_mm):
    shutil.copy(tiny_mm / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(CheckpointError, match="pickle checkpoints are never loaded"):
        Checkpoint(tmp_path)


def test_header_reader_counts_bytes(tmp_path):
    save_file({"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float8_e4m3fn)},
              tmp_path / "x.safetensors")
    infos = read_safetensors_header(tmp_path / "x.safetensors")
    assert infos["a"].nbytes == 24 and infos["b"].dtype == torch.float8_e4m3fn


def test_parse_size_units():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("4GiB") == 4 * 2**30 and parse_size("1.5MB") == 1_500_000
    with pytest.raises(ValueError):
        parse_size("5 gallons")


def test_plan_shards_exact():
    specs = [TensorSpec(f"t{i}", torch.uint8, (n,)) for i, n in enumerate([4, 4, 9, 1, 1])]
    assert [[s.name for s in sh] for sh in plan_shards(specs, 8)] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_a_single_file_beside_an_index_of_other_shards_is_refused(sharded, tiny_mm, tmp_path):
    """transformers loads model.safetensors when it exists; reading the index instead could
    convert other weights than the ones users load (fresh-user finding). An index whose one
    shard is model.safetensors itself is consistent and accepted."""
    shutil.copy(tiny_mm / "model.safetensors", sharded / "model.safetensors")
    with pytest.raises(CheckpointError, match="has both model.safetensors and model.safetensors.index.json"):
        Checkpoint(sharded)
    one = tmp_path / "one-shard-index"
    shutil.copytree(tiny_mm, one, dirs_exist_ok=True)
    names = list(Checkpoint(one).tensors)
    (one / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    assert set(Checkpoint(one).tensors) == set(names)


def test_finite_amax_is_per_expert_and_refuses_nan_and_inf_naming_the_tensor():
    """finite_amax: max |t| as fp32, per leading index for 3-D experts, a scalar otherwise,
    equal to the quantizers' weight_amax; NaN or Inf anywhere raises check_finite's error."""
    from g4.core.checkpoint import finite_amax
    from g4.quantizers.nvfp4 import weight_amax

    g = torch.Generator().manual_seed(0)
    experts = torch.randn(3, 8, 16, generator=g).bfloat16()
    got = finite_amax("e", experts)
    assert got.shape == (3,) and torch.equal(got, torch.stack([weight_amax(x) for x in experts]))
    dense = torch.randn(8, 16, generator=g).half()
    assert finite_amax("d", dense).shape == () and finite_amax("d", dense) == weight_amax(dense)
    assert finite_amax("z", torch.zeros(2, 0, 4)).tolist() == [0.0, 0.0]
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = experts.clone()
        x[2, 3, 4] = bad
        with pytest.raises(CheckpointError, match=r"^f\.safetensors: tensor e: 1 NaN/Inf value\(s\) in the source weights"):
            finite_amax("e", x, where="f.safetensors")


def test_weight_fingerprints_reuse_a_hash_only_while_the_file_is_unchanged(tmp_path, monkeypatch):
    """``hashed`` records each file's identity as it was before it was read; a record given back
    as ``known`` spares the read while the file is unchanged, and a rewritten file is read again."""
    import g4.core.checkpoint as checkpoint

    f = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(6.0)}, f)
    hashed: dict = {}
    first = checkpoint.weight_fingerprints(tmp_path, hashed=hashed)
    assert hashed[str(f.resolve())]["identity"] == checkpoint.file_identity(f)
    reads = []
    real = checkpoint.file_sha256
    monkeypatch.setattr(checkpoint, "file_sha256", lambda p: reads.append(p) or real(p))
    assert checkpoint.weight_fingerprints(tmp_path, hashed) == first and reads == []
    save_file({"w": torch.arange(6.0) + 1}, f)
    second = checkpoint.weight_fingerprints(tmp_path, hashed)
    assert reads == [f] and second["model.safetensors"]["sha256"] != first["model.safetensors"]["sha256"]


def test_a_shard_cut_short_fails_row_reads_and_comparisons_with_an_error_that_names_the_change(tmp_path):
    """Checkpoint.get_rows and .equals read by positioned reads: a shard cut short after it was
    opened gives a CheckpointError (not a SIGBUS), which FileRecords.reading turns into the one
    refusal naming the file; an error while nothing changed passes through as it was."""
    from safetensors.torch import save_file

    from g4.convert.embedded_model import EMBEDDED_DIR
    from g4.core.checkpoint import FileRecords

    t = torch.randn(512, 64).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": t, "model.layers.0.input_layernorm.weight": torch.ones(64)},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((EMBEDDED_DIR / "config.json").read_text())
    ckpt = Checkpoint(tmp_path)
    records = FileRecords.of_checkpoint(ckpt)
    ids = torch.tensor([[3, 500], [3, 0]])
    assert torch.equal(ckpt.get_rows("model.embed_tokens.weight", ids), t[ids])
    assert ckpt.equals("model.embed_tokens.weight", t, block_bytes=4096)
    with pytest.raises(CheckpointError, match="not in the checkpoint"), records.reading(tmp_path, "verify"):
        ckpt.get_rows("nope", torch.tensor([0]))  # nothing changed: the error as it was
    os.truncate(tmp_path / "model.safetensors", ckpt.tensors["model.embed_tokens.weight"].offset + 1000)
    for read in (lambda: ckpt.get_rows("model.embed_tokens.weight", torch.tensor([500])),
                 lambda: ckpt.equals("model.embed_tokens.weight", t, block_bytes=4096)):
        with pytest.raises(CheckpointError, match=r"model\.safetensors: changed while verify read it"):
            with records.reading(tmp_path, "verify"):
                read()
