"""The conversion pipeline's background pieces (`convert/pipeline.py`): source hashing while
the conversion runs gives the same digests as hashing afterwards, names an unreadable file, and
stops when the conversion is abandoned."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from g4.core.checkpoint import file_sha256
from g4.core.errors import CheckpointError
from g4.convert.pipeline import BackgroundHashes


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_background_hashes_equal_file_sha256(tmp_path, threads):
    """Each file's digest is file_sha256's, whichever thread hashed it (mapped chunk by chunk)."""
    files = {}
    for i, size in enumerate((0, 1, (16 << 20) + 3, 5000)):  # empty, tiny, over one 16 MiB chunk
        path = tmp_path / f"model-{i}.safetensors"
        path.write_bytes(os.urandom(size))
        files[path.name] = path
    got = BackgroundHashes(dict(reversed(files.items())), threads=threads).result()
    assert got == {name: file_sha256(path) for name, path in files.items()}
    assert list(got) == sorted(files)  # name order, not the order given or finished: the same manifest bytes


def test_an_unreadable_file_is_named(tmp_path):
    good = tmp_path / "a.safetensors"
    good.write_bytes(b"x" * 10)
    hashes = BackgroundHashes({"a.safetensors": good, "b.safetensors": tmp_path / "missing.safetensors"})
    with pytest.raises(CheckpointError, match=r"missing\.safetensors: cannot read to hash it"):
        hashes.result()


def test_close_stops_it_and_result_then_refuses(tmp_path):
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:
        f.truncate(4 << 30)  # sparse: 256 chunks to read
    hashes = BackgroundHashes({"big.safetensors": big})
    hashes.close()
    t = time.monotonic()
    with pytest.raises(CheckpointError, match="stopped before it finished"):
        hashes.result()
    assert time.monotonic() - t < 10  # stopped at the next chunk, not after 4 GiB



def test_a_read_error_in_the_reader_thread_reaches_the_layer_loop(tiny_mm, tmp_path):
    """A NaN in a source tensor, met by the reader thread, is raised at the loop's get of that
    tensor, naming it; the threads are stopped and nothing hangs."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from g4.core.checkpoint import Checkpoint
    from g4.convert.pipeline import overlapped

    src = shutil.copytree(tiny_mm, tmp_path / "src")
    sd = load_file(src / "model.safetensors")
    bad = "model.language_model.layers.1.mlp.up_proj.weight"
    sd[bad][0, 0] = float("nan")
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    ckpt = Checkpoint(src)
    reads = [n for n in ckpt.tensors if ".layers." in n]
    got = []
    with pytest.raises(CheckpointError, match=bad):
        with overlapped(ckpt, reads) as (reader, out):
            for name in reads:
                got.append(reader.get(name))
    assert 0 < len(got) < len(reads) and all(torch.isfinite(t).all() for t in got)


def test_a_write_error_in_the_writer_thread_is_raised_when_the_loop_ends(tiny_mm):
    import torch

    from g4.core.checkpoint import Checkpoint
    from g4.convert.pipeline import overlapped

    class BrokenWriter:
        def claim(self, name, t):
            return 0

        def put(self, slot, t, first_row=0):
            raise OSError(28, "No space left on device")

    ckpt = Checkpoint(tiny_mm)
    with pytest.raises(OSError, match="No space left"):
        with overlapped(ckpt, []) as (reader, out):
            out.write(BrokenWriter(), "x", torch.zeros(2))


def test_writer_writes_views_a_chunk_at_a_time_as_their_contiguous_bytes(tmp_path, monkeypatch):
    """``ShardedSafetensorsWriter.write`` of a non-contiguous view (a rank's column slice, a
    transpose) copies it a few rows at a time through one buffer: with chunks far smaller than
    each tensor (and rows that do not divide them), the file is byte for byte the file of the
    contiguous copies."""
    import torch

    from g4.exporters import safetensors_writer as sw

    g = torch.Generator().manual_seed(0)
    base = torch.randn(37, 24, generator=g).to(torch.bfloat16)
    experts = torch.randint(-128, 127, (5, 9, 14), dtype=torch.int8, generator=g)
    views = {"cols": base[:, 8:20], "transposed": experts[:, :, 3:11].transpose(1, 2), "contiguous": base[5:30],
             "scalar": torch.tensor(3.5)}
    assert not views["cols"].is_contiguous() and not views["transposed"].is_contiguous()
    specs = [sw.TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in views.items()]
    monkeypatch.setattr(sw, "COPY_CHUNK_BYTES", 100)  # several rows per chunk, many chunks per tensor
    for name, as_given in (("views", True), ("copies", False)):
        (tmp_path / name).mkdir()
        w = sw.ShardedSafetensorsWriter(tmp_path / name, specs, file_name="x.safetensors")
        for n, t in views.items():
            w.write(n, t if as_given else t.contiguous())
        w.close()
    assert (tmp_path / "views" / "x.safetensors").read_bytes() == (tmp_path / "copies" / "x.safetensors").read_bytes()
    from safetensors.torch import load_file

    back = load_file(tmp_path / "views" / "x.safetensors")
    assert all(torch.equal(back[n], t) for n, t in views.items())


@pytest.mark.parametrize("copy_file_range", [True, False], ids=["copy_file_range", "read-and-pwrite"])
def test_background_writer_threads_write_pieces_at_their_places(tmp_path, monkeypatch, copy_file_range):
    """Two writing threads, tensors cut into pieces of a few rows that the threads share, two
    files written at once: each file is byte for byte the file written sequentially; a tensor
    queued out of plan order is refused at once, in the caller."""
    import torch

    from g4.convert import pipeline
    from g4.core.errors import ExportError
    from g4.exporters import safetensors_writer as sw

    g = torch.Generator().manual_seed(1)
    base = torch.randn(61, 40, generator=g).to(torch.bfloat16)
    tensors = {"a": base[:, 3:33], "b": base.t(), "c": torch.randint(-128, 127, (7, 3, 50), dtype=torch.int8,
                                                                      generator=g), "d": torch.tensor(2.0), "e": base[:0]}
    specs = [sw.TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    monkeypatch.setattr(pipeline, "WRITE_PIECE_BYTES", 300)
    if not copy_file_range:  # an OS or file system without it (macOS, some network mounts)
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    monkeypatch.setattr(sw, "COPY_CHUNK_BYTES", 200)
    for d in ("seq", "bg"):
        (tmp_path / d).mkdir()
    seq = sw.ShardedSafetensorsWriter(tmp_path / "seq", specs, max_shard_bytes=4000)
    for n, t in tensors.items():
        seq.write(n, t.contiguous())
    seq.close()
    assert len(seq.files) > 1
    from safetensors.torch import save_file

    from g4.core.checkpoint import read_safetensors_header

    save_file({"pad": torch.zeros(3, dtype=torch.int8), "b": tensors["b"].contiguous()}, tmp_path / "src.safetensors")
    stored = read_safetensors_header(tmp_path / "src.safetensors")["b"]
    writers = [sw.ShardedSafetensorsWriter(tmp_path / "bg", specs, max_shard_bytes=4000),
               sw.ShardedSafetensorsWriter(tmp_path / "bg", specs, file_name="one.safetensors")]
    out = pipeline.BackgroundWriter(budget_bytes=1000, threads=2)
    for w in writers:  # "b" copied from the source file ahead of its turn, in pieces
        out.copy(w, "b", stored)
    with pytest.raises(ExportError, match="already claimed"):
        out.copy(writers[0], "b", stored)
    for n, t in tensors.items():
        for w in writers:
            if n != "b":
                out.write(w, n, t)
    with pytest.raises(ExportError, match="written out of order; expected"):
        out.write(sw.ShardedSafetensorsWriter(tmp_path / "bg", specs, file_name="x.safetensors"), "b", tensors["b"])
    out.close()
    for w in writers:
        w.close()
    for f in seq.files + ["model.safetensors.index.json"]:
        assert (tmp_path / "bg" / f).read_bytes() == (tmp_path / "seq" / f).read_bytes()
    from safetensors.torch import load_file

    one = load_file(tmp_path / "bg" / "one.safetensors")
    assert all(torch.equal(one[n], t) for n, t in tensors.items())


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is POSIX-only")
def test_the_disk_is_asked_for_each_tensor_once_in_order_within_the_budget(tiny_mm, monkeypatch):
    """DiskReadahead: every tensor's exact byte range (its header offset, its nbytes) advised
    WILLNEED once, in read order, before it is read (reading(i) returns once tensor i is asked
    for; the ones after it are asked for by its thread), and never more than the budget beyond the
    tensor being read (at least the next one); a tensor larger than the kernel's readahead
    window in pieces of that window, which cover it exactly (Linux reads at most one window
    per call); the Prefetcher's reads are unchanged by it."""
    from g4.convert import pipeline
    from g4.core.checkpoint import Checkpoint
    from g4.convert.pipeline import DiskReadahead, Prefetcher

    ckpt = Checkpoint(tiny_mm)
    names = [n for n in ckpt.tensors if ".layers." in n]
    infos = [ckpt.tensors[n] for n in names]
    piece = 1000
    assert max(i.nbytes for i in infos) > 2 * piece  # some tensors take several pieces
    monkeypatch.setattr(pipeline, "readahead_piece_bytes", lambda path: piece)
    pieces = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: pieces.append((off, n, advice)) or real(fd, off, n, advice))

    def merged():  # each tensor's pieces, joined: (offset, nbytes) per tensor asked for
        out = []
        for off, n, _ in pieces:
            assert n <= piece
            if out and out[-1][0] + out[-1][1] == off and any(i.offset == out[-1][0] and i.nbytes > out[-1][1] for i in infos):
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((off, n))
        return out

    budget = 3 * max(i.nbytes for i in infos)
    ahead = DiskReadahead(ckpt, names, budget)
    for i, info in enumerate(infos):
        ahead.reading(i)
        assert (info.offset, info.nbytes) in merged()  # before reading(i) returns
        ahead.wait_idle()  # the ones after it, asked for by its thread
        asked = merged()
        assert (info.offset, info.nbytes) in asked  # before it is read
        beyond = sum(n for off, n in asked) - sum(x.nbytes for x in infos[:i + 1])
        assert beyond < budget + max(x.nbytes for x in infos)  # stops at the first tensor past the budget
        assert len(asked) >= min(i + 2, len(infos))  # the next one always
        assert beyond + info.nbytes >= budget or len(asked) == len(infos)  # and up to the budget while tensors remain
    ahead.close()
    assert merged() == [(i.offset, i.nbytes) for i in infos]
    assert len(pieces) == sum(-(-i.nbytes // piece) for i in infos)
    assert {c[2] for c in pieces} == {os.POSIX_FADV_WILLNEED}
    pieces.clear()
    reader = Prefetcher(ckpt, names, budget_bytes=1 << 20)
    got = [reader.get(n) for n in names]
    reader.close()
    for name, t in zip(names, got):
        assert t.equal(ckpt.get(name))
    assert merged() == [(i.offset, i.nbytes) for i in infos]


def test_a_readahead_piece_is_the_devices_readahead_window(tmp_path):
    """readahead_piece_bytes: the backing device's read_ahead_kb from sysfs where Linux has it,
    never under the kernel's default 128 KiB window, and 128 KiB for a path it cannot stat."""
    from g4.convert.pipeline import readahead_piece_bytes

    f = tmp_path / "x"
    f.write_bytes(b"0")
    got = readahead_piece_bytes(f)
    dev = os.stat(f).st_dev
    sysfs = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    if sysfs.exists():
        assert got == max(int(sysfs.read_text()), 128) * 1024
    assert got >= 128 << 10
    assert readahead_piece_bytes(tmp_path / "missing") == 128 << 10


def _record_fadvise(monkeypatch):
    """Every posix_fadvise call as (path, offset, nbytes, advice), passed on to the kernel."""
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append(
        (os.readlink(f"/proc/self/fd/{fd}"), off, n, advice)) or real(fd, off, n, advice))
    return calls


def _dropped(calls) -> list[tuple[str, int, int]]:
    return [(p, off, off + n) for p, off, n, advice in calls if advice == os.POSIX_FADV_DONTNEED]


def _covered(ranges, path, a, b) -> bool:
    """Whether [a, b) of ``path`` is covered by ``ranges`` ((path, a, b) triples)."""
    at = a
    for p, x, y in sorted(r for r in ranges if r[0] == path):
        if x <= at < y:
            at = y
    return at >= b


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not hasattr(os, "posix_fadvise"),
                    reason="needs Linux posix_fadvise and /proc/self/fd")
def test_each_tensor_leaves_the_page_cache_once_the_consumer_has_dropped_it(tiny_mm, monkeypatch):
    """SourceRelease with the Prefetcher: a tensor's byte range is advised DONTNEED only after
    the consumer dropped it, never while it is held, and every range exactly once."""
    from g4.core.checkpoint import Checkpoint
    from g4.convert.pipeline import Prefetcher, SourceRelease

    ckpt = Checkpoint(tiny_mm)
    names = [n for n in ckpt.tensors if ".layers." in n]
    infos = {n: ckpt.tensors[n] for n in names}
    calls = _record_fadvise(monkeypatch)
    with SourceRelease() as release:
        reader = Prefetcher(ckpt, names, budget_bytes=1 << 20, disk_ahead_bytes=0, release=release)
        previous = None  # (name, tensor) taken before, still held while the next is taken
        for n in names:
            t = reader.get(n)
            for name in [n] + ([previous[0]] if previous else []):
                i = infos[name]
                assert not _covered(_dropped(calls), str(i.path), i.offset, i.offset + i.nbytes), \
                    f"{name} released while held"
            assert t.equal(ckpt.get(n))
            previous = (n, t)  # the one before is dropped here
            del t
        reader.close()
        del previous
    got = _dropped(calls)
    want = sorted((str(i.path), i.offset, i.offset + i.nbytes) for i in infos.values())
    assert sorted(got) == want  # each exactly once, nothing else
    assert release.released_bytes == sum(i.nbytes for i in infos.values())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not hasattr(os, "posix_fadvise"),
                    reason="needs Linux posix_fadvise and /proc/self/fd")
def test_a_hashed_source_is_hashed_behind_the_reads_and_released_behind_both(tmp_path, monkeypatch):
    """SourceRelease(hashed=True): the hash takes a byte the conversion plans to read only once it
    has been read (bytes nobody reads at once); a consumed range leaves the page cache only where
    the hash has passed it too; the digests are file_sha256's."""
    from g4.convert.pipeline import SourceRelease

    mib = 1 << 20
    monkeypatch.setattr(BackgroundHashes, "_CHUNK", mib // 4)
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(8 * mib))
    calls = _record_fadvise(monkeypatch)
    release = SourceRelease(hashed=True)
    reads, hashed = [], []  # MiB blocks read, (offset hashed, blocks read by then)
    real_read, real_hashed_to = release.read, release.hashed_to
    release.read = lambda p, off, n: reads.append(off // mib) or real_read(p, off, n)
    release.hashed_to = lambda p, off: hashed.append((off, set(reads))) or real_hashed_to(p, off)
    for blk in range(1, 8):  # block 0 (a header, a tensor nobody reads) is not planned
        release.plan(path, blk * mib, mib)
    hashes = BackgroundHashes({"model.safetensors": path}, release=release)
    time.sleep(0.3)
    assert not hashed  # nothing before plan_done
    release.plan_done()
    time.sleep(0.5)
    assert max(off for off, _ in hashed) == mib  # block 0 at once, then it waits for block 1's read
    for blk in [4, 5, 6, 7, 1, 2, 3]:  # read and consumed out of file order
        release.read(path, blk * mib, mib)
        release.consumed(path, blk * mib, mib)
        release.sweep()
        for _, x, y in _dropped(calls):
            assert y <= max(off for off, _ in hashed), "released before the hash passed it"
        time.sleep(0.1)
    got = hashes.result()
    for off, seen in hashed:  # every planned block below a hashed offset was read first
        assert set(range(1, -(-off // mib))) <= seen, (off, seen)
    release.close()
    assert got == {"model.safetensors": file_sha256(path)}
    assert _covered(_dropped(calls), str(path), mib, 8 * mib) and release.released_bytes == 7 * mib


def test_an_nvfp4_conversion_releases_every_source_tensor_it_reads(tmp_path, monkeypatch):
    """End to end: after `g4convert nvfp4` every source tensor's range was advised DONTNEED
    (the layers once quantized, the kept tensors once copied), and the result is unchanged."""
    if not (os.path.isdir("/proc/self/fd") and hasattr(os, "posix_fadvise")):
        pytest.skip("needs Linux posix_fadvise and /proc/self/fd")
    from g4.core.checkpoint import Checkpoint
    from g4.convert.embedded_model import EMBEDDED_DIR
    from g4.convert.nvfp4 import convert_nvfp4

    convert_nvfp4(EMBEDDED_DIR, tmp_path / "a", weight_only=True, algorithm="max", progress=False)
    calls = _record_fadvise(monkeypatch)
    convert_nvfp4(EMBEDDED_DIR, tmp_path / "b", weight_only=True, algorithm="max", progress=False)
    src = Checkpoint(EMBEDDED_DIR, source=True)
    dropped = _dropped(calls)
    for name, info in src.tensors.items():
        assert _covered(dropped, str(info.path), info.offset, info.offset + info.nbytes), name
    a, b = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert set(a.tensors) == set(b.tensors)


def test_the_reader_hands_out_each_tensors_amax_once(tiny_mm):
    """Prefetcher.amax: the reading thread's NaN/Inf check gives each tensor's max |t| (per
    expert for 3-D experts), taken once after its get; asking again, or before the get, fails."""
    from g4.core.checkpoint import Checkpoint, finite_amax
    from g4.convert.pipeline import Prefetcher

    ckpt = Checkpoint(tiny_mm)
    names = [n for n in ckpt.tensors if ".layers.0." in n]
    assert any(ckpt.tensors[n].shape.__len__() == 3 for n in names)  # experts among them
    reader = Prefetcher(ckpt, names, budget_bytes=1 << 20)
    with pytest.raises(KeyError):
        reader.amax(names[0])  # not handed out yet
    for n in names:
        t = reader.get(n)
        got = reader.amax(n)
        assert torch.equal(got, finite_amax(n, ckpt.get(n)))
        assert got.shape == ((t.shape[0],) if t.dim() >= 3 else ())
        with pytest.raises(KeyError):
            reader.amax(n)
    reader.close()


def test_a_checked_copy_checks_every_piece_before_copying_it_and_names_a_bad_tensor(tmp_path, monkeypatch):
    """BackgroundWriter.copy(check=): each piece is checked (Checkpoint.check_finite_part) in the
    writing thread before it is copied; a NaN in a later piece fails the copy with the whole
    tensor's count, named, at the caller's next call, and a clean tensor is copied byte for byte."""
    from safetensors.torch import save_file

    from g4.convert import pipeline
    from g4.convert.embedded_model import EMBEDDED_DIR
    from g4.core.checkpoint import Checkpoint
    from g4.exporters import safetensors_writer as sw

    good = torch.randn(64, 16).to(torch.bfloat16)
    bad = good.clone()
    bad[40, 3], bad[63, 15] = float("nan"), float("inf")  # both past the first 1000-byte piece
    names = {"good": "model.layers.0.good.weight", "bad": "model.layers.0.bad.weight"}
    save_file({names["good"]: good, names["bad"]: bad}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((EMBEDDED_DIR / "config.json").read_text())
    ckpt = Checkpoint(tmp_path)
    assert ckpt.check_finite_part(names["good"], 0, good.numel() * 2) is None
    ckpt.check_finite_part(names["bad"], 0, 1000)  # the clean first piece passes
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.bad\.weight: 2 NaN/Inf value\(s\)"):
        ckpt.check_finite_part(names["bad"], 1000, 1048)
    monkeypatch.setattr(pipeline, "WRITE_PIECE_BYTES", 1000)
    checked = []

    def check(name):
        def run(b0, n):
            checked.append((name, b0, n))
            ckpt.check_finite_part(names[name], b0, n)
        return run

    for name in ("good", "bad"):
        (tmp_path / name).mkdir()
        w = sw.ShardedSafetensorsWriter(tmp_path / name, [sw.TensorSpec(name, torch.bfloat16, (64, 16))])
        out = pipeline.BackgroundWriter(budget_bytes=1000, threads=2)
        out.copy(w, name, ckpt.tensors[names[name]], check=check(name))
        if name == "good":
            out.close()
            w.close()
            from safetensors.torch import load_file

            assert torch.equal(load_file(tmp_path / name / "model.safetensors")[name], good)
        else:
            with pytest.raises(CheckpointError, match="tensor model.layers.0.bad.weight: 2 NaN/Inf"):
                out.close()
    assert sorted(c for c in checked if c[0] == "good") == [("good", 0, 1000), ("good", 1000, 1000), ("good", 2000, 48)]


def test_a_layers_tensors_are_taken_from_the_reader_when_first_asked_for(tiny_mm, monkeypatch):
    """InOrder: a tensor is taken from the Prefetcher when first asked for (with the ones read
    before it), never earlier, and handed out once; amaxes too; an unknown name is a KeyError; take_rest takes the
    others, so the next layer's first tensor is the Prefetcher's next. The nvfp4 loop reads a
    layer in the order it produces it (production_reads): kept, dense, gate_up, down."""
    from g4.core.checkpoint import Checkpoint, finite_amax
    from g4.convert import pipeline
    from g4.convert.nvfp4 import production_reads, source_layout
    from g4.exporters.nvfp4_names import PRESETS

    ckpt = Checkpoint(tiny_mm, source=True)
    lay0, lay1 = source_layout(ckpt, PRESETS["default"], act_quant=False).layers[:2]
    order0, order1 = production_reads(lay0), production_reads(lay1)
    assert sorted(order0) == sorted(lay0.sources.values())
    assert order0[-2:] == [lay0.experts[0][0].source, lay0.experts[0][2].source]
    reader = pipeline.Prefetcher(ckpt, order0 + order1, budget_bytes=1 << 20)
    taken = []
    get = reader.get
    monkeypatch.setattr(reader, "get", lambda n: (taken.append(n), get(n))[1])
    layer = pipeline.InOrder(reader, order0)
    assert taken == []
    dense = lay0.groups[0][0].source
    assert torch.equal(layer[dense], ckpt.get(dense))
    assert taken == order0[: order0.index(dense) + 1]
    assert torch.equal(layer.amaxes[order0[0]], finite_amax(order0[0], ckpt.get(order0[0])))
    assert taken == order0[: order0.index(dense) + 1]  # already taken: nothing more
    with pytest.raises(KeyError):
        layer[order1[0]]
    with pytest.raises(KeyError):
        layer[dense]  # handed out once
    layer.take_rest()
    assert taken == order0
    assert torch.equal(pipeline.InOrder(reader, order1)[order1[0]], ckpt.get(order1[0]))
    reader.close()
