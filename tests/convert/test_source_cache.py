"""The cache of SRC's side of a comparison (g4.convert.stream.SourceSideCache): a later
`g4convert eval` against the same SRC on the same text, or `verify` with the same prompts, reads
none of SRC's decoder layers and gives the same figures, bit for bit; anything SRC's side depends
on, or a file not to be trusted, makes it compute SRC's side again."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from g4.convert.embedded_model import EMBEDDED_DIR
from g4.convert.evaluate import evaluate
from g4.convert.nvfp4 import convert_nvfp4
from g4.convert.stream import SOURCE_CACHE_ENV, SourceSideCache, SourceStream
from g4.convert.verify import verify_nvfp4
from helpers import LinkedSource

CTX, MAX_TOKENS = 128, 512
STATS = ("ppl_src", "ppl_out", "ppl_ratio", "top1_agreement", "rms_dp", "tokens", "kld", "uncertainty")


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_cache") / "w4a16"
    convert_nvfp4(EMBEDDED_DIR, out, weight_only=True, progress=False)
    return out


@pytest.fixture
def src_layers_read(monkeypatch):
    """How many decoder layers of a source checkpoint (SourceStream) were read."""
    reads = []
    real = SourceStream.layer_tensors
    monkeypatch.setattr(SourceStream, "layer_tensors", lambda self, layer: (reads.append(layer), real(self, layer))[1])
    return reads


def run(out, src, **kw):
    return evaluate(out, src, max_tokens=kw.pop("max_tokens", MAX_TOKENS), ctx=kw.pop("ctx", CTX),
                    dtype=torch.float32, write=False, **kw)


def entries(cache):
    return sorted(p.name for p in cache.glob("*.safetensors"))


def test_a_later_eval_reads_no_src_layer_and_gives_the_same_statistics(w4a16, tmp_path, monkeypatch, src_layers_read):
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(tmp_path / "cache"))
    first = run(w4a16, EMBEDDED_DIR)
    layers = len(src_layers_read)
    assert not first["src_hidden_from_cache"] and layers == SourceStream(EMBEDDED_DIR).num_layers
    assert len(entries(tmp_path / "cache")) == 1
    second = run(w4a16, EMBEDDED_DIR)
    assert second["src_hidden_from_cache"] and len(src_layers_read) == layers  # no SRC layer read again
    assert {k: second[k] for k in STATS} == {k: first[k] for k in STATS}  # bit for bit
    assert second["against"] == first["against"]  # SRC's sha256 recorded with the entry, not computed again
    monkeypatch.setenv(SOURCE_CACHE_ENV, "off")
    third = run(w4a16, EMBEDDED_DIR)
    assert not third["src_hidden_from_cache"] and {k: third[k] for k in STATS} == {k: first[k] for k in STATS}


def test_another_text_ctx_or_dtype_is_another_entry(w4a16, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(cache))
    run(w4a16, EMBEDDED_DIR)
    assert not run(w4a16, EMBEDDED_DIR, ctx=64)["src_hidden_from_cache"]
    assert not run(w4a16, EMBEDDED_DIR, max_tokens=384)["src_hidden_from_cache"]
    text = tmp_path / "t.txt"
    text.write_text("A held-out document about rivers and the sea, long enough for one chunk. " * 40)
    assert not run(w4a16, EMBEDDED_DIR, text=text)["src_hidden_from_cache"]
    assert len(entries(cache)) == 4


def test_a_changed_or_copied_source_computes_its_side_again(w4a16, tmp_path, monkeypatch, src_layers_read):
    """The key holds every SRC weight file's path, size, inode, mtime and ctime: a rewritten file
    (same bytes, even with its old mtime put back) and a copy of SRC elsewhere are other sources."""
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(tmp_path / "cache"))
    src = shutil.copytree(EMBEDDED_DIR, tmp_path / "src")
    before = run(w4a16, src)
    assert run(w4a16, src)["src_hidden_from_cache"]
    weights = next(src.glob("*.safetensors"))
    st = weights.stat()
    weights.write_bytes(weights.read_bytes())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime back: ctime still moves
    again = run(w4a16, src)
    assert not again["src_hidden_from_cache"] and again["kld"] == before["kld"]
    other = shutil.copytree(src, tmp_path / "copy")
    assert not run(w4a16, other)["src_hidden_from_cache"]


def test_against_names_the_src_given_not_the_one_that_made_the_entry(w4a16, tmp_path, monkeypatch):
    """A folder whose weights are links to a cached SRC's files, or the same SRC with another
    weight file beside them, reuses SRC's hidden states but is named (and hashed) as itself."""
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(tmp_path / "cache"))
    src = shutil.copytree(EMBEDDED_DIR, tmp_path / "src")
    run(w4a16, src)
    other = tmp_path / "other"
    other.mkdir()
    for f in src.iterdir():
        (other / f.name).symlink_to(f)
    got = run(w4a16, other)
    assert got["src_hidden_from_cache"] and got["against"]["name"] == "other"
    extra = src / "extra.safetensors"
    shutil.copy(next(src.glob("model*.safetensors")), extra)
    got = run(w4a16, src)
    assert got["src_hidden_from_cache"] and "extra.safetensors" in got["against"]["weight_files"]
    monkeypatch.setenv(SOURCE_CACHE_ENV, "off")
    assert run(w4a16, src)["against"] == got["against"]


def test_a_cache_folder_that_cannot_be_read_is_warned_about(w4a16, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(blocker / "cache"))
    got = run(w4a16, EMBEDDED_DIR)
    assert not got["src_hidden_from_cache"] and "cannot be read" in caplog.text and "not kept" in caplog.text


def test_an_entry_not_to_be_trusted_is_not_used(w4a16, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(cache))
    want = run(w4a16, EMBEDDED_DIR)
    entry = cache / entries(cache)[0]
    good = entry.read_bytes()
    kept = load_file(entry)["hidden"].clone()  # not a mapping of the file truncated below
    # damaged (truncated): computed again, and written again (the same values)
    entry.write_bytes(good[: len(good) // 2])
    got = run(w4a16, EMBEDDED_DIR)
    assert not got["src_hidden_from_cache"] and got["kld"] == want["kld"]
    assert torch.equal(load_file(entry)["hidden"], kept)
    assert "unreadable" in caplog.text
    # others may write it: not used
    entry.chmod(0o664)
    assert not run(w4a16, EMBEDDED_DIR)["src_hidden_from_cache"]
    entry.chmod(0o600)
    # another key's entry under this name (a planted file): not used, whatever its values
    src = SourceStream(EMBEDDED_DIR, torch.float32)
    planted = SourceSideCache("eval", src, {"chunks": torch.zeros(2, 8, dtype=torch.int64)})
    planted.path = entry
    planted.save({"hidden": torch.zeros(2, 8, src.config.hidden_size)}, {"name": "planted"})
    caplog.clear()
    got = run(w4a16, EMBEDDED_DIR)
    assert not got["src_hidden_from_cache"] and got["kld"] == want["kld"]
    assert "not the entry" in caplog.text


def test_the_cached_values_decide_the_statistics(w4a16, tmp_path, monkeypatch):
    """The entry is what eval uses for SRC's side (a planted change to its values under the right
    key changes the statistics): the cache is not checked against a recomputation, so its key is
    all that guards it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(cache))
    want = run(w4a16, EMBEDDED_DIR)
    entry = cache / entries(cache)[0]
    from safetensors import safe_open

    with safe_open(str(entry), framework="pt") as f:
        meta = f.metadata()
    hidden = load_file(entry)["hidden"]
    save_file({"hidden": hidden * 1.5}, entry, metadata=meta)
    got = run(w4a16, EMBEDDED_DIR)
    assert got["src_hidden_from_cache"] and got["ppl_src"] != want["ppl_src"] and got["ppl_out"] == want["ppl_out"]


# --------------------------------------------------------------------------- verify

def test_a_later_verify_reads_no_src_layer_and_gives_the_same_report(w4a16, tmp_path, monkeypatch, src_layers_read):
    """Without the cache verify reads SRC's layers once per new token and once more to compare;
    with it, not at all; the report is the same either way."""
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(tmp_path / "cache"))
    layers = SourceStream(EMBEDDED_DIR).num_layers
    first = verify_nvfp4(w4a16, EMBEDDED_DIR, max_new_tokens=3)
    passes = len(src_layers_read) / layers  # a pass per new token until every prompt ended, and the comparison
    assert not first.src_side_from_cache and passes == int(passes) and 2 <= passes <= 3 + 1
    second = verify_nvfp4(w4a16, EMBEDDED_DIR, max_new_tokens=3)
    assert second.src_side_from_cache and len(src_layers_read) == passes * layers
    same = {**vars(first), "src_side_from_cache": True}
    assert vars(second) == same and first.layer_rel_error and first.positions > 0
    monkeypatch.setenv(SOURCE_CACHE_ENV, "off")
    assert vars(verify_nvfp4(w4a16, EMBEDDED_DIR, max_new_tokens=3)) == vars(first)
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(tmp_path / "cache"))
    assert not verify_nvfp4(w4a16, EMBEDDED_DIR, max_new_tokens=2).src_side_from_cache  # other inputs
    assert len(list((tmp_path / "cache").glob("verify-*.safetensors"))) == 2


def test_a_link_pointed_elsewhere_as_verify_opens_src_keeps_no_entry_under_the_new_file(w4a16, tmp_path, monkeypatch):
    """SRC's weight-file link pointed at another file after verify opened SRC (its reads go to
    the old file) but before the cache's key was taken (a fresh user's trial): refused, and no
    entry is kept under the new file's identity, so a verify of the new file computes its own
    figures instead of the old file's."""
    import g4.convert.verify as vf
    from g4.core.errors import CheckpointError

    cache = tmp_path / "cache"
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(cache))
    linked = LinkedSource(tmp_path)
    src, weights = linked.src, linked.weights
    sd = load_file(weights)
    name = next(n for n in sd if n.endswith("layers.1.mlp.down_proj.weight"))
    sd[name] = (sd[name].float() * 1.5).to(sd[name].dtype)
    save_file(sd, linked.other, metadata={"format": "pt"})  # other figures than the first file's
    real = vf.SourceSideCache

    def relinked_first(*args, **kwargs):
        linked.change("relinked")
        return real(*args, **kwargs)

    monkeypatch.setattr(vf, "SourceSideCache", relinked_first)
    with pytest.raises(CheckpointError, match=f"{weights.name}: changed while verify read it"):
        verify_nvfp4(w4a16, src, max_new_tokens=2)
    assert entries(cache) == []
    monkeypatch.setattr(vf, "SourceSideCache", real)
    got = verify_nvfp4(w4a16, src, max_new_tokens=2)
    monkeypatch.setenv(SOURCE_CACHE_ENV, "off")
    assert not got.src_side_from_cache and vars(got) == vars(verify_nvfp4(w4a16, src, max_new_tokens=2))


@pytest.mark.parametrize("how", ["rewritten", "relinked"])
def test_a_source_changed_while_verify_reads_it_gives_no_report_and_no_entry(w4a16, tmp_path, monkeypatch, how):
    """SRC's weight file rewritten in place, or its link pointed at another file, while verify
    compares: verify refuses, as eval does, rather than report figures of two different SRCs,
    and keeps nothing; the next verify computes SRC's side afresh."""
    import g4.convert.verify as vf
    from g4.core.errors import CheckpointError

    cache = tmp_path / "cache"
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(cache))
    linked = LinkedSource(tmp_path)
    src, weights = linked.src, linked.weights
    real = vf.compare_streamed

    def meanwhile(*args, **kwargs):
        stats = real(*args, **kwargs)
        linked.change(how)
        return stats

    # SRC's side was kept before the comparison, under the old file's identity: never the new file's
    monkeypatch.setattr(vf, "compare_streamed", meanwhile)
    with pytest.raises(CheckpointError, match=f"{weights.name}: changed while verify read it"):
        verify_nvfp4(w4a16, src, max_new_tokens=2)
    monkeypatch.setattr(vf, "compare_streamed", real)
    again = verify_nvfp4(w4a16, src, max_new_tokens=2)
    assert not again.src_side_from_cache  # the entry kept before the change names the old file's identity


def test_kept_continuations_of_another_form_are_not_used(w4a16, tmp_path, monkeypatch, caplog):
    """An entry under the right key whose kept continuations are not one list of token ids per
    prompt (or whose tensors do not fit them) is refused, not trusted."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(cache))
    want = verify_nvfp4(w4a16, EMBEDDED_DIR, max_new_tokens=2)
    entry = next(cache.glob("verify-*.safetensors"))
    from safetensors import safe_open

    with safe_open(str(entry), framework="pt") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n).clone() for n in f.keys()}
    import json

    # not ids; past the vocabulary; longer than asked
    for planted in ([[1.5, 2]] * want.prompts, [[10**9, 2]] * want.prompts, [[1, 2, 3]] * want.prompts):
        save_file(tensors, entry, metadata={**meta, "facts": json.dumps({"continuations": planted})})
        caplog.clear()
        got = verify_nvfp4(w4a16, EMBEDDED_DIR, max_new_tokens=2)
        assert not got.src_side_from_cache and "not the entry" in caplog.text, planted
        assert vars(got) == vars(want)


@pytest.mark.parametrize("how", ["rewritten", "relinked"])
def test_a_source_changed_while_eval_reads_it_gives_no_report_and_no_entry(w4a16, tmp_path, monkeypatch, how):
    """SRC's weight file rewritten in place, or its link pointed at another file, after eval read
    SRC's layers: eval refuses to name files its statistics did not come from (a fresh user's
    trial: eval.json named the new file's sha256 beside the old file's statistics), and keeps nothing."""
    import g4.convert.evaluate as ev
    from g4.core.errors import CheckpointError

    cache = tmp_path / "cache"
    monkeypatch.setenv(SOURCE_CACHE_ENV, str(cache))
    linked = LinkedSource(tmp_path)
    src, weights = linked.src, linked.weights
    real = ev.final_hidden

    def meanwhile(*args, **kwargs):
        hidden = real(*args, **kwargs)
        linked.change(how)
        return hidden

    monkeypatch.setattr(ev, "final_hidden", meanwhile)
    with pytest.raises(CheckpointError, match=f"{weights.name}: changed while eval read it"):
        run(w4a16, src)
    assert entries(cache) == []
    monkeypatch.setattr(ev, "final_hidden", real)
    assert not run(w4a16, src)["src_hidden_from_cache"]  # SRC as it is now, computed afresh
