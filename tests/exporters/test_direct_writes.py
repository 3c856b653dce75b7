"""ShardedSafetensorsWriter's direct I/O: the whole 4 KiB blocks of each put go out with O_DIRECT,
the partial blocks at its ends through the page cache; the files must be the bytes of the
page-cache-only writer (G4_DIRECT_WRITE=0), loadable by safetensors, whatever the
offsets, piece sizes, views and thread interleaving, and a file system that refuses O_DIRECT
must cost nothing but the speed."""

import errno
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from g4.exporters import safetensors_writer as sw
from g4.exporters.safetensors_writer import DIRECT_BLOCK, ShardedSafetensorsWriter, TensorSpec


def _tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randint(-128, 128, (40, 300, 2011), generator=g, dtype=torch.int8)  # 24 MB: several 16 MiB buffers
    return {
        "a.tiny": torch.tensor([1, 2, 3], dtype=torch.int8),  # under two blocks: the page cache only
        "b.odd": torch.randn(5001, generator=g).bfloat16(),  # starts and ends inside a block
        "c.view": torch.randn(97, 4099, generator=g).t(),  # not contiguous: the staged path
        "d.big": big,
        "e.exact": torch.zeros(DIRECT_BLOCK * 3, dtype=torch.uint8) + 7,
        "f.tail": torch.randn(3, 7777, generator=g),
    }


def _write(out, tensors, *, pieces: bool):
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    w = ShardedSafetensorsWriter(out, specs, file_name="x.safetensors")
    jobs = []
    for n, t in tensors.items():
        slot = w.claim(n, t)
        if pieces and t.dim() and len(t) > 3:  # rows in pieces, put by two threads out of order
            cut = [0, len(t) // 3, len(t) // 3 + 1, len(t)]
            jobs += [(slot, t[a:b], a) for a, b in zip(cut, cut[1:])]
        else:
            jobs.append((slot, t, 0))
    jobs.reverse()
    threads = [threading.Thread(target=lambda js: [w.put(*j) for j in js], args=(jobs[i::2],)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    w.close()
    return (out / "x.safetensors").read_bytes()


@pytest.mark.parametrize("pieces", [False, True])
def test_direct_writes_give_the_bytes_of_the_page_cache_writer(tmp_path, monkeypatch, pieces):
    tensors = _tensors()
    opened, direct_fds, direct_bytes = [], set(), []
    real_open, real_pwrite = os.open, os.pwrite

    def spy(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            opened.append(path)
            direct_fds.add(fd)
        return fd

    def spy_pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)  # a misaligned direct write raises EINVAL here
        if fd in direct_fds:
            assert offset % DIRECT_BLOCK == 0 and len(data) % DIRECT_BLOCK == 0
            direct_bytes.append(n)
        return n

    monkeypatch.setattr(sw.os, "open", spy)
    monkeypatch.setattr(sw.os, "pwrite", spy_pwrite)
    monkeypatch.delenv(sw.DIRECT_ENV, raising=False)
    (tmp_path / "direct").mkdir()
    direct = _write(tmp_path / "direct", tensors, pieces=pieces)
    monkeypatch.setenv(sw.DIRECT_ENV, "0")
    (tmp_path / "cached").mkdir()
    n_direct = len(opened)
    cached = _write(tmp_path / "cached", tensors, pieces=pieces)
    assert len(opened) == n_direct  # G4_DIRECT_WRITE=0: no O_DIRECT descriptor at all
    if not n_direct:
        pytest.skip(f"{tmp_path}: no O_DIRECT here; the page-cache path alone was checked")
    assert direct == cached
    # every whole block inside a put went direct: all of d.big and e.exact but their end blocks
    assert sum(direct_bytes) >= tensors["d.big"].numel() - 2 * DIRECT_BLOCK, sum(direct_bytes)
    back = load_file(tmp_path / "direct" / "x.safetensors")
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(sw.DIRECT_ENV, raising=False)
    real_pwrite = os.pwrite
    direct_fds = set()
    real_open = os.open

    def spy_open(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(sw.os, "open", spy_open)
    monkeypatch.setattr(sw.os, "pwrite", refusing)
    tensors = _tensors()
    (tmp_path / "a").mkdir()
    got = _write(tmp_path / "a", tensors, pieces=True)
    monkeypatch.setenv(sw.DIRECT_ENV, "0")
    (tmp_path / "b").mkdir()
    assert got == _write(tmp_path / "b", tensors, pieces=True)
