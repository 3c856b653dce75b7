"""The conversion pipeline's background pieces (`convert/pipeline.py`): source hashing while
the conversion runs gives the same digests as hashing afterwards, names an unreadable file, and
stops when the conversion is abandoned."""

from __future__ import annotations

import os
import time

import pytest

from g4.convert.checkpoint import file_sha256
from g4.convert.errors import CheckpointError
from g4.convert.pipeline import BackgroundHashes


def test_background_hashes_equal_file_sha256(tmp_path):
    files = {}
    for i, size in enumerate((0, 1, (16 << 20) + 3, 5000)):  # empty, tiny, over one 16 MiB chunk
        path = tmp_path / f"model-{i}.safetensors"
        path.write_bytes(os.urandom(size))
        files[path.name] = path
    got = BackgroundHashes(files).result()
    assert got == {name: file_sha256(path) for name, path in files.items()}


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
