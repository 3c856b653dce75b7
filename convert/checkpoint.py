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
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError
from .resolve import SRC_FORMS

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text")
_REQUIRED_INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "intermediate_size", "moe_intermediate_size", "num_experts", "top_k_experts", "vocab_size")

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


@dataclass(frozen=True)
class TensorInfo:
    """Header facts of one stored tensor: file, dtype, shape and size in bytes."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header and check that its data section is complete.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        ``{tensor name: TensorInfo}`` (no tensor data is read).

    Raises:
        CheckpointError: unreadable header, unknown dtype, or a data section that is
            truncated, overlapping or not fully covered (a corrupt or partial download).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > size - 8:
                raise CheckpointError(f"{path}: corrupt safetensors header (length {n} for a {size}-byte file)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    infos: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        try:
            dtype = _ST_DTYPES.get(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name} has a malformed header entry ({type(e).__name__}: {e})") from e
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
        info = TensorInfo(path.name, dtype, shape)
        if end - start != info.nbytes:
            raise CheckpointError(
                f"{path}: tensor {name} spans {end - start} bytes but {info.dtype} {list(info.shape)} needs {info.nbytes}"
            )
        spans.append((start, end, name))
        infos[name] = info
    spans.sort()
    pos = 0
    for start, end, name in spans:
        if start != pos:
            raise CheckpointError(f"{path}: tensor {name} starts at byte {start}, expected {pos} (corrupt header)")
        pos = end
    if 8 + n + pos != size:
        raise CheckpointError(
            f"{path}: file is {size} bytes but its header describes {8 + n + pos} (truncated or corrupt download)"
        )
    return infos


class Checkpoint:
    """A Gemma 4 checkpoint directory opened lazily and validated up front.

    Attributes:
        root: the directory.
        config: ``config.json`` as a dict, unchanged.
        text_config: the text sub-config (``config["text_config"]`` or ``config`` itself).
        prefix: key prefix of the language model, ``"model.language_model."`` for the
            multimodal layout (``Gemma4ForConditionalGeneration``) or ``"model."`` for the
            text-only one (``Gemma4ForCausalLM``).
        tensors: ``{name: TensorInfo}`` for every stored tensor.

    Raises (from the constructor):
        CheckpointError: missing/invalid config or not Gemma 4, no safetensors, an index
            that names a missing file or tensor, a shard tensor absent from the index,
            a duplicate tensor, or a corrupt/truncated shard.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            why = "does not exist" if not self.root.exists() else "is a file, not a checkpoint directory"
            raise CheckpointError(f"{self.root}: {why} (SRC is {SRC_FORMS})")
        self.config = self._read_config()
        self.text_config = self.config.get("text_config") or self.config
        self.tensors = self._index_tensors()
        self.prefix = self._detect_prefix()
        self._handles: dict[str, object] = {}

    def _read_config(self) -> dict:
        path = self.root / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (not a Hugging Face checkpoint directory)")
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: invalid JSON: {e}") from e
        if not isinstance(config, dict):
            raise CheckpointError(f"{path}: not a JSON object")
        model_type = config.get("model_type")
        if model_type not in GEMMA4_MODEL_TYPES:
            raise CheckpointError(f"{path}: model_type is {model_type!r}, expected one of {GEMMA4_MODEL_TYPES} (Gemma 4)")
        text = config.get("text_config") or config
        if not isinstance(text, dict) or not text.get("enable_moe_block", False):
            raise CheckpointError(f"{path}: text config has no MoE block (enable_moe_block is not true); g4 converts Gemma 4 MoE models")
        for key in _REQUIRED_INT_KEYS:
            value = text.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"{path}: text config {key} is {value!r}, expected a positive integer")
        return config

    def _index_tensors(self) -> dict[str, TensorInfo]:
        index_path = self.root / INDEX_NAME
        if index_path.is_file():
            weight_map = _read_weight_map(index_path)
            files = sorted(set(weight_map.values()))
            for file in files:
                if not (self.root / file).is_file():
                    raise CheckpointError(f"{index_path}: names shard {file}, which does not exist")
        elif (self.root / SINGLE_NAME).is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            pickles = sorted(p.name for p in self.root.glob("*.bin")) + sorted(p.name for p in self.root.glob("*.pt"))
            hint = f" (found {pickles[0]}: pickle checkpoints are never loaded; convert them to safetensors)" if pickles else ""
            raise CheckpointError(f"{self.root}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in read_safetensors_header(self.root / file).items():
                if name in tensors:
                    raise CheckpointError(f"{self.root / file}: tensor {name} also stored in {tensors[name].file}")
                if weight_map is not None and weight_map.get(name) != file:
                    where = weight_map.get(name)
                    why = "is not in the index" if where is None else f"is indexed in {where}"
                    raise CheckpointError(f"{self.root / file}: tensor {name} {why}")
                tensors[name] = info
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in tensors:
                    raise CheckpointError(f"{index_path}: tensor {name} is indexed in {file} but that file does not hold it")
        return tensors

    def _detect_prefix(self) -> str:
        if any(n.startswith("model.language_model.") for n in self.tensors):
            return "model.language_model."
        if any(n.startswith("model.layers.") for n in self.tensors):
            return "model."
        raise CheckpointError(f"{self.root}: no Gemma 4 language-model tensors (model.language_model.* or model.layers.*)")

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    def layer_prefix(self, layer: int) -> str:
        """Key prefix of decoder layer ``layer``, e.g. ``model.language_model.layers.5.``."""
        return f"{self.prefix}layers.{layer}."

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (its own memory; the mmap is not kept referenced).

        Raises:
            CheckpointError: unknown name, or a shard that fails to read.
        """
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: tensor {name} is not in the checkpoint")
        try:
            return self._handle(info.file).get_tensor(name)
        except Exception as e:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{self.root / info.file}: cannot read tensor {name}: {e}") from e

    def get_finite(self, name: str) -> torch.Tensor:
        """:meth:`get`, refusing NaN/Inf.

        Raises:
            CheckpointError: ``<file>: tensor <name>: <n> NaN/Inf value(s) in the source weights``.
        """
        return check_finite(name, self.get(name), where=self.root / self.tensors[name].file)

    def get_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Gather rows of a 2-D tensor without reading the rest (e.g. embedding lookups).

        Args:
            name: a 2-D tensor ``[V, H]``.
            rows: int64 row indices, any shape ``[...]``.

        Returns:
            ``[..., H]`` tensor of the stored dtype.
        """
        info = self.tensors[name]
        sl = self._handle(info.file).get_slice(name)
        unique, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
        table = torch.stack([sl[int(r) : int(r) + 1][0] for r in unique])
        return table[inverse].reshape(*rows.shape, info.shape[-1])

    def _handle(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(str(self.root / file), framework="pt")
            self._handles[file] = handle
        return handle

    def close(self) -> None:
        """Drop the open mmaps."""
        self._handles.clear()


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
            bad = (~torch.isfinite(t)).sum().item()
            prefix = f"{where}: " if where is not None else ""
            raise CheckpointError(f"{prefix}tensor {name}: {bad} NaN/Inf value(s) in the source weights")
    return t


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
SOURCE_META_FILES = ("config.json", INDEX_NAME, "README.md", "facts.json") + SIDE_FILE_PATTERNS


def weight_files(root: Path) -> list[str]:
    """The safetensors files of the checkpoint directory ``root``: the shards its index names,
    else ``model.safetensors`` (whether or not they exist yet).

    Raises:
        CheckpointError: an index that is not JSON with a ``weight_map`` of file names.
    """
    index_path = Path(root) / INDEX_NAME
    return sorted(set(_read_weight_map(index_path).values())) if index_path.is_file() else [SINGLE_NAME]


def _read_weight_map(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: invalid index ({type(e).__name__}: {e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names")
    return weight_map


def copy_side_files(src: Path, dst: Path, *, extra: tuple[str, ...] = ()) -> list[str]:
    """Copy the tokenizer, chat template, generation and processor configs of ``src``
    (plus ``extra`` names) into ``dst``; returns the names copied."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in SIDE_FILE_PATTERNS + extra):
            shutil.copy2(f, Path(dst) / f.name)
            copied.append(f.name)
    if not _has_chat_template(Path(dst)):  # P14: the result could not serve chat completions
        logging.getLogger(__name__).warning(
            "%s has no chat template (chat_template.jinja or tokenizer_config.json chat_template); "
            "the result will not serve /v1/chat/completions until one is added", src)
    return copied


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

