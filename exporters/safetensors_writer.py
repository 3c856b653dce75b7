"""Streaming sharded safetensors output, planned before any data is produced.

The shard layout is computed from the list of output tensors (name, dtype, shape) in
production order, so each shard's header can be written first and tensor bytes then
appended as they are produced: host RAM holds one tensor at a time, never a shard.

File format: huggingface/safetensors ``docs/source/index.mdx`` (8-byte little-endian
header length, JSON header with ``dtype``/``shape``/``data_offsets``, then raw
little-endian data). Index format: transformers' ``model.safetensors.index.json``
(``metadata.total_size`` in bytes plus ``weight_map``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.convert.checkpoint import DTYPE_TO_ST, INDEX_NAME, SINGLE_NAME
from g4.convert.errors import ExportError

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``"5GB"`` is 5*10**9 (decimal), ``"5GiB"`` is 5*2**30 (binary).

    An int is a number of bytes; a string needs its unit (``"80"`` is refused, not taken
    as 80 bytes; ``"80B"`` is 80 bytes).

    Raises:
        ValueError: not a positive number with one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).upper() if m else None
        if not m or (unit and unit not in _SIZE_UNITS):
            raise ValueError(f"cannot parse size {text!r}: use e.g. 5GB (10**9 bytes) or 4GiB (2**30 bytes)")
        value = int(float(m.group(1)) * _SIZE_UNITS.get(unit, 1))
        if value > 0 and not unit:
            raise ValueError(f"size {text!r} has no unit: write e.g. {m.group(1)}GB (10**9 bytes), "
                             f"{m.group(1)}GiB (2**30 bytes) or {m.group(1)}B (bytes)")
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """An output tensor announced before it is produced."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` of data each.

    A tensor larger than the limit gets a shard of its own (as transformers does).

    Raises:
        ExportError: duplicate tensor names.
    """
    seen: set[str] = set()
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if spec.name in seen:
            raise ExportError(f"output tensor {spec.name} is produced twice")
        seen.add(spec.name)
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


def shard_file_names(n: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000i-of-0000n.safetensors``."""
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _header_bytes(shard: Sequence[TensorSpec]) -> bytes:
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        header[spec.name] = {"dtype": DTYPE_TO_ST[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class ShardedSafetensorsWriter:
    """Write planned tensors, in plan order, into sharded safetensors files.

    Either ``max_shard_bytes`` (shards ``model-0000i-of-0000n.safetensors`` plus an index)
    or ``file_name`` (everything in that one file) is given.

    Usage::

        writer = ShardedSafetensorsWriter(out_dir, specs, max_shard_bytes=5 * 10**9)
        for spec in specs:
            writer.write(spec.name, produce(spec))
        writer.close()   # checks nothing is missing, writes model.safetensors.index.json

    Raises:
        ExportError: a tensor written out of order, or whose dtype/shape differs from
            its spec; ``close()`` before every tensor was written.
    """

    def __init__(self, out_dir: Path, specs: Sequence[TensorSpec], *, max_shard_bytes: int | None = None,
                 file_name: str | None = None, index_metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        if file_name is not None:  # one named file, no index (e.g. tp0_sharded_checkpoint.safetensors)
            self.shards = plan_shards(specs, max_shard_bytes=2**63)
            self.files = [file_name]
        else:
            self.shards = plan_shards(specs, max_shard_bytes)
            self.files = shard_file_names(len(self.shards))
        self._order = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._next = 0
        self._fh = None
        self._shard = -1
        self.total_bytes = sum(spec.nbytes for _, spec in self._order)
        self._index_metadata = dict(index_metadata or {})

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (any device-independent CPU tensor) as the next planned tensor."""
        if self._next >= len(self._order):
            raise ExportError(f"output tensor {name} was not planned")
        shard_idx, spec = self._order[self._next]
        if name != spec.name:
            raise ExportError(f"output tensor {name} written out of order; expected {spec.name}")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ExportError(f"output tensor {name} is {tensor.dtype} {list(tensor.shape)}, "
                              f"planned {spec.dtype} {list(spec.shape)}")
        if shard_idx != self._shard:
            self._open(shard_idx)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._fh.write(data.data)
        self._next += 1

    def _open(self, shard_idx: int) -> None:
        if self._fh is not None:
            self._fh.close()
        self._shard = shard_idx
        self._fh = open(self.out_dir / self.files[shard_idx], "wb")
        self._fh.write(_header_bytes(self.shards[shard_idx]))

    def close(self) -> None:
        """Finish the last shard and write the index (when there is more than one shard)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._next != len(self._order):
            missing = self._order[self._next][1].name
            raise ExportError(f"output incomplete: tensor {missing} and {len(self._order) - self._next - 1} more not written")
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total_bytes, **self._index_metadata},
                "weight_map": {spec.name: self.files[i] for i, spec in self._order},
            }
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


# Files that mark a directory as a g4 result, which --overwrite may replace (their JSON
# has converter.name "g4" or a format starting with "g4-").
G4_OUTPUT_MARKERS = ("hf_quant_config.json", "manifest.json", "g4_synth.json")


def _is_g4_output(path: Path) -> bool:
    for marker in G4_OUTPUT_MARKERS:
        try:
            data = json.loads((path / marker).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and (data.get("converter", {}).get("name") == "g4"
                                       or str(data.get("format", "")).startswith("g4-")):
            return True
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(out: Path) -> None:
    """Remove ``.OUT.partial-<pid>`` dirs left by runs that were killed (SIGKILL, power loss)."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool = False, sources: Sequence[Path] = (),
                      need_bytes: int = 0) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; rename it to ``out`` only on success.

    On any exception the temporary directory is removed and an existing ``out`` is
    untouched. With ``overwrite``, an existing ``out`` is replaced only after the new
    result is complete (moved aside, new one renamed in, old one deleted), and only if it
    is empty or a previous g4 result.

    Args:
        sources: input directories; ``out`` may be neither one of them nor contain one.
        need_bytes: bytes the result will take; refused up front if the file system of
            ``out`` has less free space (the old ``out`` is kept until the end, so it
            does not count as free).

    Raises:
        ExportError: ``out`` exists without ``overwrite``; ``out`` is or contains a source
            or the working directory; ``out`` exists, is not empty and is not a g4 result;
            its parent is missing; not enough free disk space.
    """
    out = Path(out).absolute()
    resolved = out.resolve()
    guarded = [(f"SRC {Path(s).resolve()}", Path(s).resolve()) for s in sources]
    for what, path in [*guarded, ("the working directory", Path.cwd().resolve())]:
        if path == resolved or resolved in path.parents:
            raise ExportError(f"{out}: OUT would replace {what}; choose another OUT")
    if out.is_symlink():
        raise ExportError(f"{out}: is a symbolic link (to {out.resolve()}); give the real path as OUT")
    if out.exists() and not overwrite:
        raise ExportError(f"{out}: already exists; choose another OUT or pass --overwrite")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not _is_g4_output(out))):
        raise ExportError(f"{out}: exists and is not a g4 result; --overwrite only replaces g4 results "
                          "(remove it yourself if you mean it)")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent}: parent directory of OUT does not exist")
    _remove_stale_partials(out)
    free = shutil.disk_usage(out.parent).free
    if need_bytes > free:
        raise ExportError(f"{out.parent}: {free / 1e9:.2f} GB free, the result needs {need_bytes / 1e9:.2f} GB")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"{out}: cannot write the result: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
