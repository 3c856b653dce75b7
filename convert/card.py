"""Gather a g4 result's model card inputs from its files, and write ``README.md``.

The card itself is rendered by :func:`g4.exporters.model_card.render_card` from a
:class:`~g4.exporters.model_card.CardInputs`; this module reads what goes into it. At
conversion time :func:`write_model_card` stores the facts that only the source knows (its
name and Hub repo id, its weight bytes, its README front matter: license, tags, library and
pipeline) and the conversion options in ``g4_conversion.json``, then renders ``README.md``.
Everything else comes from OUT itself:

- NVFP4: safetensors headers, classified by the output table
  (``g4.exporters.nvfp4_names.Nvfp4Layout``: which linears are ``uint8`` E2M1 with their
  scales, what stayed bf16, bits per quantized weight), ``config.json`` (``quantization_config``);
- int8-neuron: ``manifest.json`` (TP degree, what was quantized, memory plan) and the rank
  files' headers;
- ``verification.json`` when present (schema of ``g4serve check``: ``g4_verification: 1``);
- ``eval.json`` when present (``g4convert eval``: ``g4_eval: 1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from g4.convert.resolve import EMBEDDED_DIR, REPO_ID_PATTERN
from g4.core.checkpoint import Checkpoint, weight_fingerprints
from g4.core.errors import a_or_an
from g4.exporters.model_card import (
    CARD_FILE,
    EVAL_FILE,
    EVAL_VERSION,
    FACTS_FILE,
    FACTS_VERSION,
    INDEX_NAME,
    NVFP4,
    SOURCE_CARD_KEYS,
    VERIFICATION_FILE,
    VLLM_TARGETS,
    CardError,
    CardInputs,
    check_facts,
    check_repo_id,
    render_card,
)
from g4.exporters.modelopt_nvfp4 import CONVERTER, declares_input_activations, declares_kv_cache, output_layout
from g4.exporters.neuron_int8 import COMPILED_STAMP, Manifest, parse_rank_name
from g4.exporters.nvfp4_names import Role
from g4.exporters.output_dir import SYNTH_MARKER
from g4.exporters.vllm_command import vllm_command

_REPO_ID = re.compile(rf"^{REPO_ID_PATTERN}$")
_HF_CACHE_DIR = re.compile(r"^models--([^/]+?)--(.+)$")


def source_repo_id(src: str | Path, config: dict | None = None) -> str | None:
    """The Hub repo id of a source checkpoint directory, when it can be known.

    From a Hugging Face cache path (``.../models--org--name/snapshots/<sha>``: where a SRC
    given as a repo id is downloaded to, see :func:`g4.convert.resolve.resolve_source`), else
    from ``config.json["_name_or_path"]`` when that is ``org/name`` and not a local path.
    Returns None otherwise (pass ``--base-model``).
    """
    cached = hf_cache_repo_id(src)
    if cached:
        return cached
    name = (config or {}).get("_name_or_path")
    if isinstance(name, str) and _REPO_ID.match(name) and not Path(name).exists():
        return name
    return None


def hf_cache_repo_id(path: str | Path) -> str | None:
    """``org/name`` when ``path`` lies in a Hugging Face cache repo folder
    (``models--org--name``), else None."""
    for part in reversed(Path(path).resolve().parts):
        m = _HF_CACHE_DIR.match(part)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    return None


def hf_cache_revision(path: str | Path) -> str | None:
    """The commit of a Hugging Face cache snapshot folder (``.../models--org--name/snapshots/<commit>``,
    where a SRC given as a repo id is resolved to), else None."""
    p = Path(path).absolute()  # not resolved: the snapshot's files are links into ../../blobs
    return p.name if p.parent.name == "snapshots" and hf_cache_repo_id(p) else None


def source_identity(src: str | Path, config: dict | None = None) -> dict:
    """What identifies a source checkpoint directory in files that can be pushed to the Hub,
    never its local path: ``{"name", "repo_id", "revision"}``. ``name`` is ``"embedded"``, the
    repo's name for a Hugging Face cache snapshot (not its commit) or the directory's name;
    ``repo_id`` and ``revision`` (the snapshot's commit) are None where they cannot be known
    (:func:`source_repo_id`, :func:`hf_cache_revision`)."""
    src = Path(src)
    if src.resolve() == EMBEDDED_DIR.resolve():
        return {"name": "embedded", "repo_id": None, "revision": None}
    return {"name": (hf_cache_repo_id(src) or src.resolve().name).split("/")[-1],
            "repo_id": source_repo_id(src, config), "revision": hf_cache_revision(src)}


def source_label(src: str | Path, config: dict | None = None) -> str:
    """One string for :func:`source_identity`: ``embedded``, ``org/name@commit``, ``org/name``
    or the directory's name (``verification.json``'s ``source``)."""
    ident = source_identity(src, config)
    if ident["repo_id"]:
        return ident["repo_id"] + (f"@{ident['revision']}" if ident["revision"] else "")
    return ident["name"]


def source_card_data(src: str | Path) -> dict:
    """The front matter keys of ``SRC/README.md`` that a derived model keeps
    (:data:`SOURCE_CARD_KEYS`); ``{}`` when the source has no README or no front matter."""
    readme = Path(src) / CARD_FILE
    if not readme.is_file():
        return {}
    from huggingface_hub.repocard import metadata_load

    try:
        meta = metadata_load(readme) or {}
    except Exception as e:  # yaml errors of several types
        raise CardError(f"{readme}: unreadable front matter ({type(e).__name__}: {e})") from e
    return {k: meta[k] for k in SOURCE_CARD_KEYS if meta.get(k) is not None}


def _weight_files(root: Path) -> list[str]:
    index = root / INDEX_NAME
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in root.glob("*.safetensors"))


def stored_dtypes(ckpt: Checkpoint) -> str:
    """The dtype(s) the checkpoint's tensors are stored in, as torch names them, e.g.
    ``"bfloat16"`` or ``"bfloat16, float32"`` (sorted): what the tensors are, not what
    ``config.json``'s ``dtype`` says (an F32 upcast of a BF16 model may keep ``"bfloat16"`` there)."""
    return ", ".join(sorted({str(info.dtype).removeprefix("torch.") for info in ckpt.tensors.values()}))


def synthetic_source(root: str | Path) -> dict:
    """``{"synthetic": {"layers", "seed"}}`` when ``root`` was written by ``g4convert synth``
    (its :data:`~g4.exporters.output_dir.SYNTH_MARKER`: random weights), else ``{}``."""

    path = Path(root) / SYNTH_MARKER
    if not path.is_file():
        return {}
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):
        marker = None
    marker = marker if isinstance(marker, dict) else {}
    return {"synthetic": {"layers": marker.get("layers"), "seed": marker.get("seed")}}


def write_model_card(tmp: str | Path, fmt: str, *, src: Checkpoint, out_name: str, options: dict,
                     layout=None) -> None:
    """Write ``g4_conversion.json`` and the rendered ``README.md`` into a conversion's
    temporary output directory ``tmp`` (before it is renamed to OUT).

    Args:
        tmp: the directory holding the finished result files.
        fmt: ``"nvfp4"`` or ``"int8-neuron"``.
        src: the source checkpoint as the conversion opened it (its config and resolved
            shards are used as held; its README front matter and shard sizes are read).
        out_name: the final OUT directory name (used in the card until it is pushed).
        options: the result-affecting conversion options; a ``calib_data`` path is
            stored as its file name and sha256, never as a local path.
        layout: an NVFP4 result's output table as the converter wrote it (default: rebuilt from ``tmp``).

    Raises:
        CardError: unreadable source README front matter.
    """
    config, shards = src.config, src.shards  # the files the conversion read, as it resolved them
    tmp, src_ckpt, src = Path(tmp), src, src.root
    opts = {}
    for k, v in sorted(options.items()):
        if k == "calib_data" and v is not None:
            p = Path(v)
            v = {"name": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        opts[k] = v
    facts = {
        "g4_conversion": FACTS_VERSION,
        "format": fmt,
        "g4_version": g4_version(),
        "base_model": None,
        "source": source_identity(src, config) | {
            "weight_files": list(shards),
            "weight_bytes": sum(path.stat().st_size for path in shards.values()),
            "dtype": stored_dtypes(src_ckpt),
            "card": source_card_data(src),
        } | synthetic_source(src),
        "options": opts,
    }
    _write_json_atomic(tmp / FACTS_FILE, facts)
    _write_text_atomic(tmp / CARD_FILE, card_text(tmp, name=out_name, facts=facts, layout=layout))


# The last line of every card g4 writes: the sha256 of the text above it. A README.md whose
# text no longer matches its line (or has none) is its owner's, and g4 does not write over it.
_CARD_STAMP = re.compile(r"\n<!-- g4 card sha256 ([0-9a-f]{64}) -->\n\Z")


def _stamped(body: str) -> str:
    return f"{body}\n<!-- g4 card sha256 {hashlib.sha256(body.encode('utf-8')).hexdigest()} -->\n"


def edited_card(out: str | Path) -> str | None:
    """The text of ``OUT/README.md`` when it is not a card as g4 wrote it (edited since, or
    without g4's sha256 line); None when it is g4's own or absent."""
    path = Path(out) / CARD_FILE
    if not path.is_file():
        return None
    text = path.read_bytes().decode("utf-8", errors="replace")
    stamp = _CARD_STAMP.search(text)
    if stamp and hashlib.sha256(text[: stamp.start()].encode("utf-8")).hexdigest() == stamp.group(1):
        return None
    return text


def g4_version() -> str:
    """The installed g4's version (its distribution metadata; the converter version when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("g4")
    except metadata.PackageNotFoundError:
        return CONVERTER["version"]


def load_conversion_facts(out: str | Path) -> dict:
    """``OUT/g4_conversion.json``.

    Raises:
        CardError: missing (not a g4 result, or one converted before g4 wrote model
            cards), unreadable, or of an unknown version.
    """
    path = Path(out) / FACTS_FILE
    if not path.is_file():
        raise CardError(f"{out}: no {FACTS_FILE}; not a g4 nvfp4/int8-neuron result, or converted by an older g4 "
                        "(convert it again)")
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CardError(f"{path}: unreadable ({e})") from e
    return check_facts(facts, str(path))


def set_base_model(out: str | Path, base_model: str) -> bool:
    """Record ``base_model`` (a Hub repo id ``org/name``) in OUT's facts and re-render
    OUT's ``README.md`` (both written atomically) unless its owner has edited it.

    Returns:
        True when the edited ``README.md`` was kept (not re-rendered).

    Raises:
        CardError: not a repo id, or OUT has no facts file.
    """
    check_repo_id(base_model, what="--base-model")
    facts = load_conversion_facts(out)
    facts["base_model"] = base_model
    write_facts(out, facts)
    kept = edited_card(out) is not None
    write_card(out, facts=facts)
    return kept


def write_facts(out: str | Path, facts: dict) -> None:
    """Replace ``OUT/g4_conversion.json`` with ``facts`` (atomically; the card is not re-rendered)."""
    _write_json_atomic(Path(out) / FACTS_FILE, check_facts(facts, str(Path(out) / FACTS_FILE)))


def write_card(out: str | Path, *, repo_id: str | None = None, facts: dict | None = None) -> str:
    """Re-render ``OUT/README.md`` from OUT's files (atomic replace) unless its owner has
    edited it (:func:`edited_card`): then it is left as it is. Returns README.md's text.
    ``facts``: OUT's ``g4_conversion.json`` when the caller holds it."""
    mine = edited_card(out)
    if mine is not None:
        return mine
    text = card_text(out, repo_id=repo_id, facts=facts)
    _write_text_atomic(Path(out) / CARD_FILE, text)
    return text


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_json_atomic(path: Path, data: dict) -> None:
    _write_text_atomic(path, json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- reading OUT


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str  # safetensors dtype string: BF16, U8, F8_E4M3, F32, I8, ...
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _header(path: Path) -> list[_Tensor]:
    """Tensor entries of a safetensors file (format: huggingface/safetensors README: 8-byte
    little-endian header length, then a JSON header). Read directly so that rendering a
    card does not import torch."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise CardError(f"{path}: unreadable safetensors header ({e})") from e
    header.pop("__metadata__", None)
    return [_Tensor(k, v["dtype"], tuple(v["shape"]), v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in sorted(header.items())]


def repo_files(out: str | Path, *, include_card: bool = False) -> list[tuple[str, int]]:
    """(posix path relative to ``out``, size in bytes) of every file a Hub repo of this
    result holds, sorted; hidden files and folders (``.cache``, temp files) are not part of
    it, nor is ``README.md`` unless ``include_card``, nor a Neuron compile inside OUT (a folder
    holding ``g4_compiled.json``: machine-specific, with this machine's paths in NxDI's
    ``neuron_config.json``)."""
    out = Path(out)
    compiled = {p.parent for p in out.rglob(COMPILED_STAMP)}
    rows = []
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if p.is_file() and (include_card or rel != CARD_FILE) and not any(part.startswith(".")
                                                                           for part in rel.split("/")) \
                and not any(c in p.parents for c in compiled):
            rows.append((rel, p.stat().st_size))
    return rows


def _nvfp4_facts(out: Path, layout=None) -> dict:
    """What the NVFP4 files hold, classified by the output table (``exporters/nvfp4_names.py``;
    ``layout``: the converter's, default rebuilt from OUT), and the serve commands for OUT."""
    layout = layout or output_layout(Checkpoint(out))
    weight_files = _weight_files(out)
    tensors = [t for f in weight_files for t in _header(out / f)]
    by_name = {t.name: t for t in tensors}
    linears = [lin for lin in layout.linears
               if lin.name(Role.WEIGHT) in by_name and by_name[lin.name(Role.WEIGHT)].dtype == "U8"]
    member = {n for lin in linears for n in lin.names}
    quant: dict[str, dict] = {}
    params = qbytes = 0
    for lin in linears:
        q = quant.setdefault(lin.kind, {"linears": 0, "layers": set(), "experts": set()})
        q["linears"] += 1
        q["layers"].add(lin.layer)
        if lin.expert is not None:
            q["experts"].add(lin.expert)
        params += by_name[lin.name(Role.WEIGHT)].numel * 2  # two E2M1 codes per byte
        qbytes += sum(by_name[n].nbytes for n in lin.names if n in by_name)
    kept: dict[str, dict] = {}
    for t in tensors:
        if t.name in member:
            continue
        o = layout.by_name.get(t.name)
        k = kept.setdefault(o.kind if o is not None else "other", {"tensors": 0, "dtypes": set(), "bytes": 0})
        k["tensors"] += 1
        k["dtypes"].add(t.dtype)
        k["bytes"] += t.nbytes
    config = json.loads((out / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    kv = "fp8" if declares_kv_cache(config) else None  # calibrated KV cache scales: serve them
    commands = [(label, vllm_command(out, compute_capability=cc, vllm_version=version, kv_cache_dtype=kv))
                for label, cc, version in VLLM_TARGETS]
    return {"quant": quant, "kept": kept, "params": params, "qbytes": qbytes,
            "w4a4": declares_input_activations(config), "kv_cache": declares_kv_cache(config),
            "ignore": qc.get("ignore", []),
            "producer": qc.get("producer") or {}, "weight_files": weight_files,
            "weights_out": sum((out / f).stat().st_size for f in weight_files),
            "model_dir": str(out), "commands": commands}


def _int8_facts(out: Path) -> dict:
    manifest = Manifest.from_dir(out)
    rank_files = manifest.rank_files
    tensors = _header(out / rank_files[0])
    by_name = {t.name: t for t in tensors}
    q8: dict[str, int] = Counter()
    numel = qbytes = 0
    for t in tensors:
        r = parse_rank_name(t.name)
        if r is not None and r.entry.int8 and t.name == r.entry.names(r.prefix)[0] and t.dtype == "I8":
            scale = by_name.get(r.entry.names(r.prefix)[1])
            q8[r.kind] += 1
            numel += t.numel
            qbytes += t.nbytes + (scale.nbytes if scale is not None else 0)
    rank_bytes = [(f, (out / f).stat().st_size) for f in rank_files]
    host = manifest.host_embedding or {}
    return {"manifest": manifest, "int8_tensors": dict(q8), "numel": numel, "qbytes": qbytes,
            "rank_bytes": rank_bytes,
            "host_bytes": (out / host["file"]).stat().st_size if host.get("file") else 0}


def _check_file(out: Path, name: str, key: str, version: int) -> dict | None:
    """``OUT/name`` (``verification.json`` or ``eval.json``) when present, with ``stale``: why it
    is not about OUT's current weights (None when it is).

    Raises:
        CardError: unreadable, or not a ``key`` version ``version`` file.
    """
    path = out / name
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CardError(f"{path}: unreadable ({e})") from e
    if not isinstance(data, dict) or data.get(key) != version:
        raise CardError(f"{path}: not {a_or_an(key)} version {version} file")
    data["stale"] = _stale_reason(out, data.get("files"), what=name)
    return data


def _stale_reason(out: Path, files, *, what: str = VERIFICATION_FILE) -> str | None:
    """Why a verification (or evaluation, ``what``) is not about OUT's current weights (None when
    it is): the ``files`` fingerprints it recorded, compared by size, then sha256."""
    if not isinstance(files, dict) or not files:
        return f"{what} does not record which weights it checked"
    now = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*.safetensors"))}
    if set(now) != set(files) or any(now[k] != (files[k] or {}).get("bytes") for k in now):
        return "the weight files changed since the check"
    if weight_fingerprints(out) != files:
        return "the weight files changed since the check"
    return None


def card_inputs(out: str | Path, *, repo_id: str | None = None, name: str | None = None,
                base_model: str | None = None, facts: dict | None = None, layout=None) -> CardInputs:
    """Read what the model card of the g4 result in ``out`` shows.

    Args:
        out: a g4 result directory (with ``g4_conversion.json``).
        repo_id: the Hub repo it is pushed to; the serve commands then name it. Default:
            the directory, by its name ``name`` (default ``out``'s name).
        base_model: overrides the facts' ``base_model`` (for a dry run; nothing is written).
        facts: OUT's ``g4_conversion.json`` when the caller holds it (not re-read).
        layout: an NVFP4 result's output table when the caller holds it (not rebuilt).

    Raises:
        CardError: OUT has no or unreadable facts, headers, verification or evaluation file; a repo id
            or ``base_model`` that is not a Hub repo id.
    """
    out = Path(out)
    facts = dict(check_facts(facts, str(out / FACTS_FILE)) if facts is not None else load_conversion_facts(out))
    if base_model is not None:
        facts["base_model"] = check_repo_id(base_model, what="--base-model")
    if repo_id is not None:
        check_repo_id(repo_id)
    nvfp4 = _nvfp4_facts(out, layout) if facts["format"] == NVFP4 else None
    return CardInputs(facts=facts, name=name or out.name, files=repo_files(out), verification=_check_file(out, VERIFICATION_FILE, "g4_verification", 1),
                      evaluation=_check_file(out, EVAL_FILE, "g4_eval", EVAL_VERSION), repo_id=repo_id, nvfp4=nvfp4, int8=None if nvfp4 is not None else _int8_facts(out))


def card_text(out: str | Path, **kw) -> str:
    """:func:`~g4.exporters.model_card.render_card` of :func:`card_inputs` (same arguments),
    ending in g4's sha256 line (:func:`edited_card`)."""
    return _stamped(render_card(card_inputs(out, **kw)))
