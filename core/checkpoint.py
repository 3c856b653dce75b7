"""Lazy, validated access to a Hugging Face Gemma 4 checkpoint directory.

A checkpoint is ``config.json`` plus either one ``model.safetensors`` or shards listed
in ``model.safetensors.index.json`` (format: huggingface/safetensors ``docs/source/index.mdx``
and transformers ``modeling_utils.py`` sharded save). Tensors are read through
``safetensors.safe_open`` (mmap) one at a time; nothing ever holds the whole model.
Pickle files (``*.bin``, ``*.pt``) are never opened.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import mmap
import os
import shutil
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import safe_open

from g4.core.errors import CheckpointError, G4Error, a_or_an
from g4.core.gemma4 import MULTIMODAL_PREFIX, TEXT_PREFIX, Architecture, read_architecture, release_config
from g4.quantizers.nvfp4 import weight_amax  # the one definition of a weight's amax

SRC_FORMS = "a local checkpoint directory, 'embedded', or a Hub repo id owner/name[@revision]"
"""What SRC may be (g4.convert.resolve resolves it), for the messages that name it."""

CONFIG_NAME = "config.json"  # a Hugging Face checkpoint's config (transformers.utils.CONFIG_NAME)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
DTYPE_TO_ST = {v: k for k, v in _ST_DTYPES.items()}
# The one list of dtypes g4 reads as real source values (weights, norms, scalars). Anything else
# in a source (float8, int8/uint8 codes, int4 packs in integer containers, bool, float64) is
# refused: a real Gemma 4 checkpoint stores every tensor, buffers included, in BF16.
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class TensorInfo:
    """Header facts of one stored tensor.

    Attributes:
        file: the shard's name as written in the index (relative to the checkpoint
            directory), or ``model.safetensors``; for messages and manifests.
        dtype, shape: as stored.
        path: the shard file itself, symlinks resolved once: the file whose header was
            checked, which is hashed and from which the tensor is read.
        offset: byte offset of the tensor's data in ``path`` (raw little-endian, contiguous).
    """

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: Path
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_safetensors_header(path: Path, *, file: str | None = None, shown: Path | str | None = None
                            ) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header and check that its data section is complete.

    Args:
        path: a ``.safetensors`` file (read, and kept as ``TensorInfo.path``).
        file: the name recorded as ``TensorInfo.file`` (default ``path.name``).
        shown: how the file is named in error messages (default ``path``).

    Returns:
        ``{tensor name: TensorInfo}`` (no tensor data is read).

    Raises:
        CheckpointError: unreadable header, unknown dtype, or a data section that is
            truncated, overlapping or not fully covered (a corrupt or partial download).
    """
    label, path = path if shown is None else shown, Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{label}: not a safetensors file (shorter than its 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > size - 8:
                raise CheckpointError(f"{label}: corrupt safetensors header (length {n} for "
                                      f"{a_or_an(str(size) + '-byte')} file)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{label}: cannot read safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{label}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    infos: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        try:
            dtype = _ST_DTYPES.get(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{label}: tensor {name} has a malformed header entry ({type(e).__name__}: {e})") from e
        if dtype is None:
            raise CheckpointError(f"{label}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
        info = TensorInfo(file or path.name, dtype, shape, path, 8 + n + start)
        if end - start != info.nbytes:
            raise CheckpointError(
                f"{label}: tensor {name} spans {end - start} bytes but {info.dtype} {list(info.shape)} needs {info.nbytes}"
            )
        spans.append((start, end, name))
        infos[name] = info
    spans.sort()
    pos = 0
    for start, end, name in spans:
        if start != pos:
            raise CheckpointError(f"{label}: tensor {name} starts at byte {start}, expected {pos} (corrupt header)")
        pos = end
    if 8 + n + pos != size:
        raise CheckpointError(
            f"{label}: file is {size} bytes but its header describes {8 + n + pos} (truncated or corrupt download)"
        )
    return infos


def _check_shard_name(root: Path, index_path: Path, file: str) -> None:
    """Refuse an index entry that is absolute or has a ``..`` component (see :func:`read_index`)."""
    posix, windows = PurePosixPath(file), PureWindowsPath(file)
    if posix.is_absolute() or windows.drive or windows.root:
        raise CheckpointError(f"{index_path}: names shard {file}, an absolute path; shard names must be relative "
                              f"to the checkpoint directory {root}")
    if ".." in windows.parts:  # PureWindowsPath splits on both / and \\
        raise CheckpointError(f"{index_path}: names shard {file}, which has a '..' component; shard names must "
                              f"stay inside the checkpoint directory {root}")
    if not file.endswith(".safetensors"):  # never a pickle (.bin, .pt) or another format, nor fetched from a Hub
        raise CheckpointError(f"{index_path}: names shard {file!r}, which is not a .safetensors file; g4 reads "
                              "safetensors weights only")


def _shard_path(root: Path, index_path: Path, file: str) -> Path:
    """The file an index entry names, as every reader must use it (see :func:`read_index`)."""
    _check_shard_name(root, index_path, file)
    joined = root / file
    if not joined.is_file():
        why = "is not a regular file" if joined.exists() else "does not exist"  # a folder, a device, a FIFO
        raise CheckpointError(f"{index_path}: names shard {file}, which {why}")
    return joined.resolve(strict=True)


def _read_weight_map(index_path: Path) -> dict[str, str]:
    """``weight_map`` of an index: tensor name -> shard name as written.

    Raises:
        CheckpointError: not JSON, no ``weight_map``, or values that are not non-empty strings.
    """
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: invalid index ({type(e).__name__}: {e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names")
    return weight_map


def read_index(root: str | Path) -> tuple[dict[str, str] | None, dict[str, Path]]:
    """Which files hold a checkpoint's tensors: the one shard-name check every reader uses.

    A shard is named in ``model.safetensors.index.json`` relative to ``root``, as Hugging
    Face loaders join it: a plain relative name, subfolders allowed (``sub/x.safetensors``),
    never an absolute path or a ``..`` component. The file itself may be a symlink to
    anywhere (the Hub cache links every snapshot file to ``../../blobs/<sha256>``); it is
    resolved here once, and that resolved path is the file whose header is checked, which
    is hashed into manifests and which tensors are read from.

    Returns:
        (``weight_map`` of the index, or None for a single ``model.safetensors``;
        ``{shard name as written: resolved path}``, sorted by name).

    Raises:
        CheckpointError: unreadable index, a shard name that is not a non-empty string, is
            absolute or has a ``..`` component (naming the index and the shard), a missing
            shard, a ``model.safetensors`` beside an index of other shards (which one is the
            model is ambiguous), or no safetensors weights at all.
    """
    root = Path(root)
    index_path = root / INDEX_NAME
    if index_path.is_file():
        weight_map = _read_weight_map(index_path)
        others = sorted(set(weight_map.values()) - {SINGLE_NAME})
        if (root / SINGLE_NAME).is_file() and others:
            # transformers and vLLM load model.safetensors when it exists; g4 would read the index
            raise CheckpointError(f"{root}: has both {SINGLE_NAME} and {INDEX_NAME} naming other shards "
                                  f"({others[0]}{', ...' if len(others) > 1 else ''}); transformers loads "
                                  f"{SINGLE_NAME}, so the two may hold different weights: remove the one that "
                                  "is not the model")
        return weight_map, {file: _shard_path(root, index_path, file) for file in sorted(set(weight_map.values()))}
    if (root / SINGLE_NAME).is_file():
        return None, {SINGLE_NAME: (root / SINGLE_NAME).resolve(strict=True)}
    pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    hint = f" (found {pickles[0]}: pickle checkpoints are never loaded; convert them to safetensors)" if pickles else ""
    raise CheckpointError(f"{root}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")


def quantized_reason(root: str | Path, config: dict) -> str | None:
    """Why the checkpoint at ``root`` (with ``config.json`` contents ``config``) is already
    quantized, or None: a ``quantization_config`` (or compressed-tensors' older
    ``compression_config``), even an empty one, at the top level or in ``text_config`` or
    ``vision_config`` (its ``quant_method`` named), or an ``hf_quant_config.json`` beside it
    (its ``quant_algo``)."""
    root = Path(root)
    subs = [(f"{k}.", config[k]) for k in ("text_config", "vision_config") if isinstance(config.get(k), dict)]
    for where, cfg in [("", config), *subs]:
        key = next((k for k in ("quantization_config", "compression_config") if cfg.get(k) is not None), None)
        qc = cfg.get(key) if key else None
        if key:
            method = qc.get("quant_method") if isinstance(qc, dict) else None
            named = f" (quant_method {method!r})" if method else ""
            return f"{root / 'config.json'}: {where}{key}{named}"
    hf_quant = root / HF_QUANT_CONFIG
    if hf_quant.exists():
        try:
            algo = (json.loads(hf_quant.read_text()).get("quantization") or {}).get("quant_algo")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            algo = None
        return f"{hf_quant}: present" + (f" (quant_algo {algo!r})" if algo else "")
    return None


def refuse_quantized(root: str | Path, config: dict) -> None:
    """Refuse an already quantized source (:func:`quantized_reason`).

    Raises:
        CheckpointError: ``<file>: <what>: the checkpoint is already quantized; ...``.
    """
    why = quantized_reason(root, config)
    if why:
        raise CheckpointError(f"{why}: the checkpoint is already quantized; g4 converts unquantized "
                              "BF16/F16/F32 Gemma 4 checkpoints (use the original release weights)")


class Checkpoint:
    """A Gemma 4 checkpoint directory opened lazily and validated up front.

    Attributes:
        root: the directory.
        config: ``config.json`` as a dict, unchanged.
        text_config: the text sub-config (``config["text_config"]`` or ``config`` itself).
        arch: the model as :func:`g4.core.gemma4.read_architecture` reads ``config``.
        prefix: key prefix of the language model, ``"model.language_model."`` for the
            multimodal layout (``Gemma4ForConditionalGeneration``) or ``"model."`` for the
            text-only one (``Gemma4ForCausalLM``).
        tensors: ``{name: TensorInfo}`` for every stored tensor.
        shards: ``{shard name as written: resolved file}`` (:func:`read_index`); every
            read, hash and size of a shard goes through these paths.
        shard_records: ``{shard name: [resolved file, *file_identity]}`` taken before its header
            was read (:meth:`FileRecords.of_checkpoint`).

    Args (constructor):
        root: the checkpoint directory.
        source: open it as a conversion source (SRC of ``g4convert nvfp4``/``int8-neuron``/
            ``plan``, ``--against`` of ``verify``/``g4serve check``): refuse an already
            quantized checkpoint (:func:`quantized_reason`) and any tensor whose dtype is
            not in :data:`SOURCE_DTYPES`. Results (OUT) are opened with ``source=False``.

    Raises (from the constructor):
        CheckpointError: missing/invalid config or not Gemma 4, no safetensors, an index
            that names a missing file or tensor or a shard outside ``root`` (absolute,
            ``..``), a shard tensor absent from the index, a duplicate tensor, or a
            corrupt/truncated shard; with ``source``: an already quantized checkpoint, a side
            file that would travel into OUT broken (:func:`check_side_files`), or
            ``<shard>: tensor <name> is stored as <dtype>`` for a dtype g4 cannot read as values.
    """

    def __init__(self, root: str | Path, *, source: bool = False, defer_template_check: bool = False):
        self.root = Path(root)
        if not self.root.is_dir():
            why = "does not exist" if not self.root.exists() else "is a file, not a checkpoint directory"
            raise CheckpointError(f"{self.root}: {why} (SRC is {SRC_FORMS})")
        self.config = self._read_config()
        self._template_check: _Background | None = None
        if source:
            refuse_quantized(self.root, self.config)
            check_side_files(self.root, chat_template=not defer_template_check)
            if defer_template_check:
                self._template_check = _Background(check_chat_template, self.root)
        self.text_config = self.config.get("text_config") or self.config
        self.tensors = self._index_tensors()
        if source:
            self._check_source_dtypes()
        self.prefix = self._detect_prefix()
        self._handles: dict[Path, object] = {}

    def side_files_checked(self) -> None:
        """Wait for the chat-template check a ``defer_template_check`` source runs in the
        background (:func:`check_chat_template`); raises its CheckpointError. A conversion calls it
        once its first layer is done, and again before its result is finished."""
        if self._template_check is not None:
            self._template_check.result()

    def _read_config(self) -> dict:
        path = self.root / CONFIG_NAME
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (not a Hugging Face checkpoint directory)")
        config = read_json_object(path)
        try:
            self.arch: Architecture = read_architecture(config)
        except G4Error as e:
            raise CheckpointError(f"{path}: {e}") from e
        return config

    def _index_tensors(self) -> dict[str, TensorInfo]:
        index_path = self.root / INDEX_NAME
        weight_map, self.shards = read_index(self.root)
        tensors: dict[str, TensorInfo] = {}
        self.shard_records: dict[str, list] = {}  # FileRecords.of_checkpoint: taken before any byte is read
        for file, path in self.shards.items():
            shown = self.root / file
            try:
                self.shard_records[file] = FileRecords.record(path)
            except OSError as e:
                raise CheckpointError(f"{shown}: cannot be read ({e.strerror or e})") from e
            for name, info in read_safetensors_header(path, file=file, shown=shown).items():
                if name in tensors:
                    raise CheckpointError(f"{shown}: tensor {name} also stored in {tensors[name].file}")
                if weight_map is not None and weight_map.get(name) != file:
                    where = weight_map.get(name)
                    why = "is not in the index" if where is None else f"is indexed in {where}"
                    raise CheckpointError(f"{shown}: tensor {name} {why}")
                tensors[name] = info
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in tensors:
                    raise CheckpointError(f"{index_path}: tensor {name} is indexed in {file} but that file does not hold it")
        return tensors

    def _check_source_dtypes(self) -> None:
        for name, info in self.tensors.items():
            if info.dtype not in SOURCE_DTYPES:
                ok = "/".join(DTYPE_TO_ST[d] for d in SOURCE_DTYPES)
                raise CheckpointError(
                    f"{self.root / info.file}: tensor {name} is stored as {DTYPE_TO_ST[info.dtype]}; g4 reads source "
                    f"tensors as {ok} values only (quantized or integer-coded weights cannot be converted)")

    def _detect_prefix(self) -> str:
        if any(n.startswith(MULTIMODAL_PREFIX) for n in self.tensors):
            return MULTIMODAL_PREFIX
        if any(n.startswith(TEXT_PREFIX + "layers.") for n in self.tensors):
            return TEXT_PREFIX
        raise CheckpointError(f"{self.root}: no Gemma 4 language-model tensors (model.language_model.* or model.layers.*)")

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def layer_prefix(self, layer: int) -> str:
        """Key prefix of decoder layer ``layer``, e.g. ``model.language_model.layers.5.``."""
        return f"{self.prefix}layers.{layer}."

    def get(self, name: str) -> torch.Tensor:
        """One tensor as stored. With safetensors 0.8 (measured) it is a view of the shard's mmap,
        not a copy: its pages are read when touched, count as this process's file-backed RSS while
        it lives, and stay mapped after :meth:`close` until it is dropped (other versions may copy).

        Raises:
            CheckpointError: unknown name, or a shard that fails to read.
        """
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: tensor {name} is not in the checkpoint")
        try:
            return self._handle(info).get_tensor(name)
        except Exception as e:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{self.root / info.file}: cannot read tensor {name}: {e}") from e

    def read(self, name: str) -> torch.Tensor:
        """One tensor copied out of its file by positioned reads of exactly its bytes, with the
        kernel's readahead off for that read (``POSIX_FADV_RANDOM``): for the small tensors read
        back from a file whose pages are not in the page cache (g4's results are written with
        direct I/O, ``g4.exporters.safetensors_writer``), where a fault on :meth:`get`'s mmap
        reads a whole readahead window of the neighbouring tensors' bytes from the disk.

        Raises:
            CheckpointError: unknown name, or a shard that cannot be read or ends early.
        """
        return self.read_many([name])[name]

    def read_many(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """:meth:`read` of several tensors, ``{name: tensor}``: each shard opened once, its
        readahead off, and its tensors read in file order (an NVFP4 result's export check reads
        three scales per linear, 11,700 small tensors for a 10-layer 26B-A4B: with an open,
        advice and close each, its conversion took 44.2 s against 42.7 s, A/B).

        Raises:
            CheckpointError: unknown name, or a shard that cannot be read or ends early.
        """
        by_path: dict[Path, list[tuple[int, str, TensorInfo]]] = {}
        for name in names:
            info = self.tensors.get(name)
            if info is None:
                raise CheckpointError(f"{self.root}: tensor {name} is not in the checkpoint")
            by_path.setdefault(info.path, []).append((info.offset, name, info))
        out: dict[str, torch.Tensor] = {}
        for path, items in by_path.items():
            items.sort(key=lambda x: x[0])
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                name, info = items[0][1], items[0][2]
                raise CheckpointError(f"{self.root / info.file}: cannot read tensor {name}: {e.strerror or e}") from e
            try:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                for _, name, info in items:
                    out[name] = self._pread(fd, name, info)
            finally:
                os.close(fd)
        return out

    def _pread(self, fd: int, name: str, info: TensorInfo) -> torch.Tensor:
        """Tensor ``name`` read from the open shard ``fd`` (exactly its bytes)."""
        data = bytearray(info.nbytes)
        try:
            _pread_exact(fd, memoryview(data), info.offset)
        except OSError as e:
            raise CheckpointError(f"{self.root / info.file}: cannot read tensor {name}: {e.strerror or e}") from e
        if not info.nbytes:
            return torch.empty(info.shape, dtype=info.dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(info.dtype).reshape(info.shape)

    def get_finite(self, name: str) -> torch.Tensor:
        """:meth:`get`, refusing NaN/Inf.

        Raises:
            CheckpointError: ``<file>: tensor <name>: <n> NaN/Inf value(s) in the source weights``.
        """
        return check_finite(name, self.get(name), where=self.root / self.tensors[name].file)

    def check_finite_part(self, name: str, first_byte: int, nbytes: int) -> None:
        """:func:`check_finite` of the stored bytes ``[first_byte, first_byte + nbytes)`` of tensor
        ``name`` (whole elements; e.g. a piece the conversion's writer copies,
        ``g4.convert.pipeline.BackgroundWriter.copy``), read through a mapping of just those
        bytes (no copy), unmapped before it returns: any thread may call it, and the pages it
        touched count in this process's RSS only meanwhile (read through the shard's open mmap,
        as :meth:`get` reads, a 26B-A4B's 1.5 GB of kept tensors stayed mapped to the
        conversion's end, and could not leave the page cache). A part that holds NaN/Inf is
        reported with the count of the whole tensor, as :meth:`get_finite` does.

        Raises:
            CheckpointError: ``<file>: tensor <name>: <n> NaN/Inf value(s) in the source weights``,
                or an unknown name or unreadable shard.
        """
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: tensor {name} is not in the checkpoint")
        if not info.dtype.is_floating_point or not nbytes:
            return
        if self._non_finite(name, info, first_byte, nbytes, count=False):
            bad = self._non_finite(name, info, 0, info.nbytes, count=True)
            raise non_finite_error(name, bad, where=self.root / info.file)

    def _non_finite(self, name: str, info: TensorInfo, first_byte: int, nbytes: int, *, count: bool) -> int:
        """NaN/Inf values among stored bytes ``[first_byte, first_byte + nbytes)`` of tensor ``name``:
        their number with ``count``, else 1 if any (one ``aminmax`` pass). Read through a mapping
        of just those bytes that is closed before this returns, with no tensor on it left behind
        (copy-on-write, never written: torch takes only writable buffers; reads share the page
        cache's pages)."""
        start = info.offset + first_byte
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            with open(info.path, "rb") as f:
                m = mmap.mmap(f.fileno(), start - base + nbytes, offset=base, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.root / info.file}: cannot read tensor {name}: {e}") from e
        view = None
        try:
            view = torch.frombuffer(m, dtype=info.dtype, count=nbytes // info.dtype.itemsize, offset=start - base)
            lo, hi = torch.aminmax(view)
            bad = 0 if torch.isfinite(lo) and torch.isfinite(hi) else (
                int((~torch.isfinite(view)).sum()) if count else 1)
        finally:
            view = None  # frombuffer keeps no export of m: no view may outlive the mapping, not even in a traceback
            m.close()
        return bad

    def get_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Gather rows of a 2-D tensor without reading the rest (e.g. embedding lookups).

        Args:
            name: a 2-D tensor ``[V, H]``.
            rows: int64 row indices, any shape ``[...]``.

        Returns:
            ``[..., H]`` tensor of the stored dtype.
        """
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: tensor {name} is not in the checkpoint")
        unique, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
        row_bytes = info.nbytes // info.shape[0]
        table = bytearray(len(unique) * row_bytes)
        view = memoryview(table)
        with self._positioned(name, info) as fd:
            for i, r in enumerate(unique.tolist()):
                _pread_exact(fd, view[i * row_bytes : (i + 1) * row_bytes], info.offset + r * row_bytes)
        rows_t = torch.frombuffer(table, dtype=torch.uint8).view(info.dtype).reshape(len(unique), *info.shape[1:])
        return rows_t[inverse].reshape(*rows.shape, *info.shape[1:])

    def equals(self, name: str, tensor: torch.Tensor, *, block_bytes: int = 64 << 20) -> bool:
        """Whether the stored tensor ``name`` has ``tensor``'s dtype, shape and values (bit for
        bit), read ``block_bytes`` of leading-dimension rows at a time, so that no second whole
        copy is made (the eval's head phase compares a result's ``[V, H]`` head, 1.48 GB for the
        26B, with its source's this way).

        Raises:
            CheckpointError: unknown name, or a shard that fails to read.
        """
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: tensor {name} is not in the checkpoint")
        if info.dtype != tensor.dtype or tuple(info.shape) != tuple(tensor.shape):
            return False
        if not info.shape or info.nbytes == 0:  # a scalar or empty: no blocks
            return torch.equal(self.get(name).reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
        row_bytes = info.nbytes // info.shape[0]
        rows = max(1, block_bytes // row_bytes)
        buf = bytearray(min(rows, info.shape[0]) * row_bytes)
        with self._positioned(name, info) as fd:
            for r in range(0, info.shape[0], rows):
                n_rows = min(rows, info.shape[0] - r)
                part = memoryview(buf)[: n_rows * row_bytes]
                _pread_exact(fd, part, info.offset + r * row_bytes)
                block = torch.frombuffer(part, dtype=torch.uint8)
                if not torch.equal(block, tensor[r : r + n_rows].contiguous().reshape(-1).view(torch.uint8)):
                    return False
        return True

    @contextmanager
    def _positioned(self, name: str, info: TensorInfo):
        """The open shard holding tensor ``name``, for positioned reads (copies: a shard cut short
        meanwhile is an error, not a SIGBUS); an OSError in the block becomes a CheckpointError
        naming the file and the tensor."""
        try:
            fd = os.open(info.path, os.O_RDONLY)
            try:
                yield fd
            finally:
                os.close(fd)
        except OSError as e:
            raise CheckpointError(f"{self.root / info.file}: cannot read tensor {name}: {e.strerror or e}") from e

    def _handle(self, info: TensorInfo):
        handle = self._handles.get(info.path)
        if handle is None:  # the resolved shard whose header was checked, never a re-joined name
            handle = safe_open(str(info.path), framework="pt")
            self._handles[info.path] = handle
        return handle

    def close(self) -> None:
        """Drop the open mmaps."""
        self._handles.clear()


def _pread_exact(fd: int, view: memoryview, at: int) -> None:
    """Fill ``view`` with the bytes of ``fd`` from offset ``at`` (positioned reads; a short read
    continues). Raises OSError, also when the file ends first (a shard cut short)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], at + done)
        if n == 0:
            raise OSError(f"ends {len(view) - done} bytes before the tensor's end")
        done += n


def check_finite(name: str, t: torch.Tensor, *, where: Path | str | None = None) -> torch.Tensor:
    """Return ``t``, or raise naming it (and the file ``where`` it is stored) if it holds
    NaN/Inf (one fast ``aminmax`` pass: NaN propagates through min/max, Inf shows as an
    infinite extreme).

    Raises:
        CheckpointError: ``[<file>: ]tensor <name>: <n> NaN/Inf value(s) in the source weights``.
    """
    if t.is_floating_point() and t.numel():
        lo, hi = torch.aminmax(t)
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            raise non_finite_error(name, (~torch.isfinite(t)).sum().item(), where=where)
    return t


def non_finite_error(name: str, bad: int, *, where: Path | str | None = None) -> CheckpointError:
    """The error for a source tensor holding ``bad`` NaN/Inf values (:func:`check_finite`)."""
    prefix = f"{where}: " if where is not None else ""
    return CheckpointError(f"{prefix}tensor {name}: {bad} NaN/Inf value(s) in the source weights")


def finite_amax(name: str, t: torch.Tensor, *, where: Path | str | None = None) -> torch.Tensor:
    """``max(|t|)`` as fp32, refusing NaN/Inf as :func:`check_finite` does (the same one pass,
    ``aminmax``, which also gives the amax): per index of the leading dimension (fp32 ``[E]``)
    for a tensor of 3 or more dimensions (experts ``[E, out, in]``: the per-expert amax of
    NVFP4's per-expert global scales, :func:`g4.quantizers.nvfp4.quantize_experts`), else fp32
    ``[]``. Exact: the max of bf16/fp16 values is one of them. An integer or empty tensor: 0.

    Raises:
        CheckpointError: ``[<file>: ]tensor <name>: <n> NaN/Inf value(s) in the source weights``.
    """
    experts = t.dim() >= 3
    parts = list(t) if experts else [t]  # views of each expert
    amax = torch.zeros(len(parts), dtype=torch.float32)
    if t.is_floating_point():
        for i, x in enumerate(parts):
            if x.numel():
                amax[i] = weight_amax(x)
        if not torch.isfinite(amax).all():
            check_finite(name, t, where=where)  # raises, counting the values
    return amax if experts else amax[0]


# What travels with converted weights (case P14): tokenizer, chat template, generation and
# processor configs. An allow-list, so stale quantization metadata, other weight formats
# (.gguf, .bin) or READMEs of the source are never carried into OUT.
SIDE_FILE_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                      "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                      "generation_config.json", "processor_config.json", "preprocessor_config.json",
                      "video_preprocessor_config.json")


# Everything else g4 reads of a source checkpoint (the safetensors weights aside): a Hub repo
# id is downloaded with exactly these top-level files, the side files and the shards the index
# names (convert/resolve.py), never pickles (*.bin, *.pt), other weight formats or folders.
SOURCE_META_FILES = (CONFIG_NAME, INDEX_NAME, "README.md", "facts.json",
                     HF_QUANT_CONFIG) + SIDE_FILE_PATTERNS  # hf_quant_config.json: to refuse a quantized repo


def weight_files(root: Path) -> list[str]:
    """The safetensors files of the checkpoint directory ``root`` as its index names them (the
    shard-name rules of :func:`read_index` checked), else ``model.safetensors``; whether or not
    they exist yet (a Hub download fetches exactly these).

    Raises:
        CheckpointError: an unreadable index, or a shard name :func:`read_index` refuses.
    """
    root = Path(root)
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        return [SINGLE_NAME]
    files = sorted(set(_read_weight_map(index_path).values()))
    for file in files:
        _check_shard_name(root, index_path, file)
    return files


def check_side_files(src: Path, *, chat_template: bool = True) -> None:
    """Check the side files of ``src`` that :func:`copy_side_files` would carry into OUT, so that a
    broken one stops the conversion up front instead of the server that loads OUT later: every
    ``*.json`` must be a JSON object and, with ``chat_template``, ``chat_template.jinja`` must
    compile (:func:`check_chat_template`).

    Raises:
        CheckpointError: ``<file>: invalid JSON (...)`` or ``<file>: invalid chat template (...)``.
    """
    for f in sorted(Path(src).iterdir()):
        if not (f.is_file() and f.suffix == ".json" and any(fnmatch.fnmatch(f.name, p) for p in SIDE_FILE_PATTERNS)):
            continue
        try:
            value = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{f}: unreadable ({e})") from e
        except ValueError as e:
            raise CheckpointError(f"{f}: invalid JSON ({e})") from e
        if not isinstance(value, dict):
            raise CheckpointError(f"{f}: invalid JSON (not an object)")
    if chat_template:
        check_chat_template(src)


def check_chat_template(src: Path) -> None:
    """Check that ``src/chat_template.jinja``, where there is one, compiles as transformers
    compiles chat templates (huggingface/transformers ``src/transformers/utils/chat_template_utils.py``).
    Imports transformers (1.3 s here) only where there is a template.

    Raises:
        CheckpointError: ``<file>: unreadable (...)`` or ``<file>: invalid chat template (...)``.
    """
    f = Path(src) / "chat_template.jinja"
    if not f.is_file():
        return
    try:
        text = f.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from e
    import jinja2
    from transformers.utils import chat_template_utils

    # transformers' own compiler (its sandbox and extensions: loopcontrols, {% generation %}),
    # where this version has it under that name; else a plain Jinja parse with loopcontrols
    compile_template = getattr(chat_template_utils, "_compile_jinja_template", None) or (
        lambda text: jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text))
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"{f}: invalid chat template (line {e.lineno}: {e.message})") from e


class _Background:
    """``fn(*args)`` run in a daemon thread; :meth:`result` waits for it and raises what it raised."""

    def __init__(self, fn, *args):
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the thread that waits for it
                self._error = e

        self._thread = threading.Thread(target=run, name=f"g4-{fn.__name__}", daemon=True)
        self._thread.start()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer, chat template, generation and processor configs of ``src`` into
    ``dst``; returns the names copied."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in SIDE_FILE_PATTERNS):
            shutil.copy2(f, Path(dst) / f.name)
            copied.append(f.name)
    if not _has_chat_template(Path(dst)):  # P14: the result could not serve chat completions
        logging.getLogger(__name__).warning(
            "%s has no chat template (chat_template.jinja or tokenizer_config.json chat_template); "
            "the result will not serve /v1/chat/completions until one is added", src)
    return copied


def read_json_object(path: str | Path, *, shown: str | Path | None = None,
                     error: type[G4Error] = CheckpointError) -> dict:
    """The JSON object in the file ``path`` (a config, an index, a manifest).

    Args:
        shown: how the file is named in the message (default ``path``).
        error: the g4 error type to raise (the caller's kind of failure).

    Raises:
        ``error``: ``<file>: unreadable (...)`` (I/O), ``<file>: invalid JSON (...)`` (not UTF-8 JSON)
            or ``<file>: not a JSON object``.
    """
    where = path if shown is None else shown
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise error(f"{where}: unreadable ({type(e).__name__}: {e})") from e
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # JSON files are UTF-8
        raise error(f"{where}: invalid JSON ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise error(f"{where}: not a JSON object")
    return data


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, streamed (``hashlib.file_digest``): source hashes in
    manifests, the Hub's LFS oid, verification fingerprints."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _has_chat_template(root: Path) -> bool:
    if (root / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((root / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def file_identity(path: str | Path) -> list[int]:
    """``[size, inode, device, mtime_ns, ctime_ns]`` of the file ``path`` resolves to: any write to
    it changes its ctime, which no user tool sets back (``touch`` and ``cp --preserve`` set the
    mtime only), so an equal identity means the same bytes as when it was taken."""
    st = Path(path).resolve().stat()
    return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


class FileRecords:
    """What a set of files were when this was made: ``{name: [resolved path, *file_identity]}``
    (:attr:`files`), each file by the path ``root / name`` (a link pointed elsewhere later, or a
    file rewritten or replaced, is then seen by :meth:`changed`). For a reader of SRC's weight
    files that must not report figures computed from two different versions of them.

    Raises (constructor):
        OSError: a file cannot be stat'ed.
    """

    def __init__(self, root: str | Path, names: Sequence[str], files: dict[str, list] | None = None):
        self._paths = {name: Path(root) / name for name in sorted(names)}
        self.files = {name: self.record(path) for name, path in self._paths.items()} if files is None else {
            name: list(files[name]) for name in self._paths}

    @classmethod
    def of_checkpoint(cls, ckpt: "Checkpoint") -> "FileRecords":
        """The records of ``ckpt``'s shards as they were when it was opened, before any byte of
        them was read (:attr:`Checkpoint.shard_records`): a file changed, or a link pointed
        elsewhere, after that (even before this call) is seen by :meth:`changed`."""
        return cls(ckpt.root, list(ckpt.shards), ckpt.shard_records)

    @staticmethod
    def record(path: str | Path) -> list:
        """``[resolved path, *file_identity]`` of the file ``path``."""
        return [str(Path(path).resolve()), *file_identity(path)]

    @contextmanager
    def reading(self, root: str | Path, command: str):
        """A block that reads these files: a CheckpointError it raises while one of them has
        changed (a shard cut short by a rewrite ends a read early) becomes the refusal of
        :func:`source_changed_message` naming ``root / <file>`` and ``command``.

        Raises:
            CheckpointError: that refusal, or the block's own error.
        """
        try:
            yield
        except CheckpointError as e:
            if (name := self.changed()) is not None:
                raise CheckpointError(source_changed_message(Path(root) / name, command)) from e
            raise

    def check_unchanged(self, root: str | Path, command: str) -> None:
        """Refuse (:func:`source_changed_message`, naming ``root / <file>`` and ``command``) if
        one of the files has :meth:`changed`.

        Raises:
            CheckpointError: a file changed.
        """
        if (name := self.changed()) is not None:
            raise CheckpointError(source_changed_message(Path(root) / name, command))

    def changed(self) -> str | None:
        """The name of the first file whose resolved path or :func:`file_identity` is not what it
        was (rewritten, replaced, a link retargeted, removed), or None."""
        for name, path in self._paths.items():
            try:
                if self.record(path) != self.files[name]:
                    return name
            except OSError:
                return name
        return None


def source_changed_message(path: str | Path, command: str) -> str:
    """The one wording of a refusal by ``command`` (eval, verify, g4serve check) whose SRC weight
    file ``path`` changed while it read SRC (:meth:`FileRecords.changed`)."""
    return (f"{path}: changed while {command} read it (rewritten, replaced or relinked), so its figures would "
            f"mix two versions of SRC; nothing was written or reported: run {command} again")


def weight_fingerprints(out: str | Path, known: dict[str, dict] | None = None,
                        hashed: dict[str, dict] | None = None) -> dict[str, dict]:
    """``{relative path: {"bytes", "sha256"}}`` of every ``*.safetensors`` file under ``out``
    (sorted): which weights a verification is about, so that a model card never shows a
    result for files changed since (streamed).

    Args:
        known: ``{resolved path: {"identity": file_identity, "sha256": hex}}`` of files hashed
            before; a file whose identity is unchanged is not read again.
        hashed: filled with the same records for every file here, each identity taken before its
            file was read (a file written while it was hashed then never matches its record).
    """
    out = Path(out)
    known = known or {}

    def sha256(p: Path) -> str:
        identity, where = file_identity(p), str(p.resolve())
        k = known.get(where)
        if isinstance(k, dict) and k.get("identity") == identity and isinstance(k.get("sha256"), str):
            digest = k["sha256"]
        else:
            digest = file_sha256(p)
        if hashed is not None:
            hashed[where] = {"identity": identity, "sha256": digest}
        return digest

    return {p.relative_to(out).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
            for p in sorted(out.rglob("*.safetensors"))}


def check_converted_from(out: str | Path, src: str | Path) -> None:
    """The one rule of every command that compares a result OUT with its source SRC (``verify``,
    ``eval``, ``g4serve check``): OUT's ``config.json``, its ``quantization_config`` aside, must
    be SRC's, both in the release form (g4 writes OUT's config so,
    :func:`g4.core.gemma4.release_config`; a bf16 OUT may be in either form).

    Raises:
        CheckpointError: ``<OUT>: its config.json differs from <SRC>'s (key, ...)``.
    """
    out_cfg = release_config(read_json_object(Path(out) / CONFIG_NAME))  # a bf16 OUT may be in either form
    src_cfg = release_config(Checkpoint(src, source=True).config)
    out_cfg = {k: v for k, v in out_cfg.items() if k != "quantization_config"}
    if out_cfg != src_cfg:
        keys = sorted(k for k in out_cfg.keys() | src_cfg.keys() if out_cfg.get(k) != src_cfg.get(k))
        raise CheckpointError(f"{out}: its config.json differs from {src}'s ({', '.join(keys)}); was it converted "
                              "from another checkpoint? pass --against SRC")
