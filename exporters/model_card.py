"""The model card (``README.md``) of a g4 result, rendered from the files in OUT alone.

At conversion time :func:`write_model_card` stores the facts that only the source knows
(its name and Hub repo id, its weight bytes, its README front matter: license, tags,
library and pipeline) and the conversion options in ``g4_conversion.json`` (schema below),
then renders ``README.md``. Everything else comes from OUT itself, so ``g4convert push``
can re-render the card later, e.g. after ``g4serve check`` added ``verification.json``:

- NVFP4: safetensors headers (which linears are ``uint8`` E2M1 with their scales, what
  stayed bf16, bits per quantized weight), ``config.json`` (``quantization_config``);
- int8-neuron: ``manifest.json`` (TP degree, what was quantized, memory plan) and the rank
  files' headers;
- ``verification.json`` when present (schema of ``g4serve check``: ``g4_verification: 1``).

The same OUT (and the same ``repo_id``) always gives the same bytes: no timestamps, no
absolute paths, every listing sorted. Metadata go through huggingface_hub's
``ModelCardData`` / ``ModelCard`` (front matter keys as in huggingface_hub
``repocard_data.py``; ``base_model_relation: quantized`` as the Hub's model tree reads it).

``g4_conversion.json`` (version 1)::

    {"g4_conversion": 1, "format": "nvfp4" | "int8-neuron", "g4_version": "0.1.0",
     "base_model": "org/name" | null,
     "source": {"name", "repo_id" | null, "revision" (HF cache commit) | null, "weight_bytes", "weight_files", "dtype",
                "card": {license, license_name, license_link, library_name, tags,
                         pipeline_tag, language} (only keys the source README has)},
     "options": {...the result-affecting options of the conversion...}}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from g4.convert.errors import ExportError, G4Error
from g4.convert.resolve import EMBEDDED_DIR, REPO_ID_PATTERN

FACTS_FILE = "g4_conversion.json"
CARD_FILE = "README.md"
VERIFICATION_FILE = "verification.json"
FACTS_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
NVFP4, INT8_NEURON = "nvfp4", "int8-neuron"

FORMAT_TAGS = {NVFP4: ["nvfp4", "modelopt", "vllm"], INT8_NEURON: ["neuron", "inferentia2", "int8"]}
# Front matter keys copied from the source README (huggingface_hub ModelCardData fields).
SOURCE_CARD_KEYS = ("license", "license_name", "license_link", "library_name", "pipeline_tag", "language", "tags")
_REPO_ID = re.compile(rf"^{REPO_ID_PATTERN}$")
_HF_CACHE_DIR = re.compile(r"^models--([^/]+?)--(.+)$")
_MAX_PROMPT_ROWS = 10


class CardError(G4Error):
    """OUT lacks what its model card needs (not a g4 result, unreadable facts)."""


# --------------------------------------------------------------------------- facts at conversion time


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


def write_model_card(tmp: str | Path, fmt: str, *, src: str | Path, out_name: str, options: dict) -> None:
    """Write ``g4_conversion.json`` and the rendered ``README.md`` into a conversion's
    temporary output directory ``tmp`` (before it is renamed to OUT).

    Args:
        tmp: the directory holding the finished result files.
        fmt: ``"nvfp4"`` or ``"int8-neuron"``.
        src: the source checkpoint directory (read: config, README front matter, the
            sizes of its safetensors files in bytes).
        out_name: the final OUT directory name (used in the card until it is pushed).
        options: the result-affecting conversion options; a ``calib_data`` path is
            stored as its file name and sha256, never as a local path.

    Raises:
        CardError: unreadable source README front matter.
    """
    from g4.convert.checkpoint import read_index

    tmp, src = Path(tmp), Path(src)
    config = json.loads((src / "config.json").read_text())
    embedded = src.resolve() == EMBEDDED_DIR.resolve()
    _, shards = read_index(src)  # the files the conversion read, as it resolved them
    text = config.get("text_config") or {}
    opts = {}
    for k, v in sorted(options.items()):
        if k == "calib_data" and v is not None:
            p = Path(v)
            v = {"name": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        opts[k] = v
    facts = {
        "g4_conversion": FACTS_VERSION,
        "format": fmt,
        "g4_version": _g4_version(),
        "base_model": None,
        "source": {
            "name": "embedded" if embedded else (hf_cache_repo_id(src) or src.resolve().name).split("/")[-1],
            "repo_id": None if embedded else source_repo_id(src, config),
            "revision": None if embedded else hf_cache_revision(src),
            "weight_files": list(shards),
            "weight_bytes": sum(path.stat().st_size for path in shards.values()),
            "dtype": config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype"),
            "card": source_card_data(src),
        },
        "options": opts,
    }
    _write_json_atomic(tmp / FACTS_FILE, facts)
    _write_text_atomic(tmp / CARD_FILE, render_card(tmp, name=out_name))


def _g4_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("g4")
    except metadata.PackageNotFoundError:
        from g4.exporters.modelopt_nvfp4 import CONVERTER

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
    if not isinstance(facts, dict) or facts.get("g4_conversion") != FACTS_VERSION or facts.get("format") not in FORMAT_TAGS:
        raise CardError(f"{path}: not a g4_conversion version {FACTS_VERSION} file")
    return facts


def set_base_model(out: str | Path, base_model: str) -> None:
    """Record ``base_model`` (a Hub repo id ``org/name``) in OUT's facts and re-render
    OUT's ``README.md`` (both written atomically).

    Raises:
        CardError: not a repo id, or OUT has no facts file.
    """
    check_repo_id(base_model, what="--base-model")
    facts = load_conversion_facts(out)
    facts["base_model"] = base_model
    _write_json_atomic(Path(out) / FACTS_FILE, facts)
    write_card(out)


def check_repo_id(repo_id: str, *, what: str = "REPO_ID") -> str:
    """Return ``repo_id`` if it is a Hub ``namespace/name``.

    Raises:
        CardError: anything else (a bare name, a URL, a local path).
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise CardError(f"{what} {repo_id!r} is not a Hub repo id ({str(e).splitlines()[0]})") from e
    if repo_id.count("/") != 1:
        raise CardError(f"{what} {repo_id!r}: give it as namespace/name")
    return repo_id


def write_card(out: str | Path, *, repo_id: str | None = None) -> str:
    """Re-render ``OUT/README.md`` from OUT's files (atomic replace) and return its text."""
    text = render_card(out, repo_id=repo_id)
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
    it, nor is ``README.md`` unless ``include_card``."""
    out = Path(out)
    rows = []
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if p.is_file() and (include_card or rel != CARD_FILE) and not any(part.startswith(".")
                                                                           for part in rel.split("/")):
            rows.append((rel, p.stat().st_size))
    return rows


def _nvfp4_facts(out: Path) -> dict:
    """What the NVFP4 files hold, classified by the output table (``exporters/nvfp4_names.py``)."""
    from g4.convert.checkpoint import Checkpoint
    from g4.exporters.modelopt_nvfp4 import output_layout
    from g4.exporters.nvfp4_names import Role

    layout = output_layout(Checkpoint(out))
    tensors = [t for f in _weight_files(out) for t in _header(out / f)]
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
    w4a4 = any("input_activations" in g for g in (qc.get("config_groups") or {}).values())
    return {"quant": quant, "kept": kept, "params": params, "qbytes": qbytes, "w4a4": w4a4,
            "ignore": qc.get("ignore", []), "producer": qc.get("producer") or {},
            "weight_files": _weight_files(out)}


def _int8_facts(out: Path) -> dict:
    from g4.exporters.neuron_int8 import Manifest, parse_rank_name

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


def _verification(out: Path) -> dict | None:
    path = out / VERIFICATION_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CardError(f"{path}: unreadable ({e})") from e
    if not isinstance(data, dict) or data.get("g4_verification") != 1:
        raise CardError(f"{path}: not a g4_verification version 1 file")
    data["stale"] = _stale_reason(out, data.get("files"))
    return data


def _stale_reason(out: Path, files) -> str | None:
    """Why a verification is not about OUT's current weights (None when it is): the
    ``files`` fingerprints ``g4serve check`` recorded, compared by size, then sha256."""
    from g4.convert.checkpoint import weight_fingerprints

    if not isinstance(files, dict) or not files:
        return "verification.json does not record which weights it checked"
    now = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*.safetensors"))}
    if set(now) != set(files) or any(now[k] != (files[k] or {}).get("bytes") for k in now):
        return "the weight files changed since the check"
    if weight_fingerprints(out) != files:
        return "the weight files changed since the check"
    return None


# --------------------------------------------------------------------------- rendering


def _size(n: int | float | None) -> str:
    """Bytes in decimal units (GB = 10**9 bytes), three significant decimals."""
    if n is None:
        return "unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{int(n)} B"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _cell(text) -> str:
    """A table cell: a missing value (None) as a dash, pipes escaped, one line."""
    return "-" if text is None else str(text).replace("|", "\\|").replace("\n", " ")


def _count(n: int, noun: str) -> str:
    """``1 layer``, ``2 layers``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _hub_link(repo_id: str | None, name: str) -> str:
    return f"[{repo_id}](https://huggingface.co/{repo_id})" if repo_id else f"`{name}`"


def _card_data(facts: dict, repo_id: str | None):
    from huggingface_hub import ModelCardData

    src_card = dict(facts["source"].get("card") or {})
    base = facts.get("base_model") or facts["source"].get("repo_id")
    tags = list(src_card.pop("tags", None) or [])
    if isinstance(tags, str):
        tags = [tags]
    tags += [t for t in FORMAT_TAGS[facts["format"]] if t not in tags]
    if facts["format"] == INT8_NEURON:
        # The rank files load in neither transformers nor the source's library: no
        # library_name, and a text-only pipeline (the vision tower is not exported).
        src_card.pop("library_name", None)
        src_card["pipeline_tag"] = "text-generation"
    extra = {"base_model_relation": "quantized"} if base else {}
    return ModelCardData(base_model=base, tags=tags, **src_card, **extra)


def _how_made(facts: dict, out_name: str) -> str:
    src = facts["source"]
    o = facts["options"]
    repo = facts.get("base_model") or src.get("repo_id")
    src_arg = "embedded" if src["name"] == "embedded" else repo or src["name"]  # SRC may be a Hub repo id
    if repo and repo == src.get("repo_id") and src.get("revision"):  # the exact commit converted, so that the
        # command reproduces this result after the repo moves on
        src_arg = f"{repo}@{src['revision']}"
    if facts["format"] == NVFP4:
        argv = ["g4convert", "nvfp4", src_arg, out_name, "--preset", o.get("preset", "default")]
        if o.get("weight_only"):
            argv.append("--weight-only")
        else:
            if o.get("calib_data"):
                argv += ["--calib-data", o["calib_data"]["name"]]
            argv += ["--calib-samples", str(o.get("calib_samples")), "--calib-seq-len", str(o.get("calib_seq_len")),
                     "--calib-dtype", str(o.get("calib_dtype"))]
        argv += ["--max-shard-size", str(o.get("max_shard_size"))]
    else:
        argv = ["g4convert", "int8-neuron", src_arg, out_name, "--tp", str(o.get("tp"))]
        if o.get("quantize_attention"):
            argv.append("--quantize-attention")
        if o.get("target"):
            argv += ["--target", str(o["target"])]
        if o.get("force"):
            argv.append("--force")
    return shlex.join(argv)


def _nvfp4_body(out: Path, facts: dict, model_ref: str, nv: dict) -> dict:
    from g4.exporters.vllm_command import vllm_command

    order = ("experts", "dense MLP", "attention", "other")
    qrows = []
    for kind in sorted(nv["quant"], key=lambda k: order.index(k) if k in order else len(order)):
        q = nv["quant"][kind]
        where = _count(len(q["layers"]), "layer") + (f" x {_count(len(q['experts']), 'expert')}" if q["experts"] else "")
        qrows.append([kind, q["linears"], where])
    krows = [[k, v["tensors"], ", ".join(sorted(v["dtypes"])), _size(v["bytes"])] for k, v in sorted(nv["kept"].items())]
    bpw = nv["qbytes"] * 8 / max(nv["params"], 1)
    weights_out = sum((out / f).stat().st_size for f in nv["weight_files"])
    commands = []
    for label, cc, version in (("Blackwell (compute capability 10.0, W4A4 FP4 kernels)", (10, 0), None),
                               ("Hopper (compute capability 9.0, weight-only Marlin kernels), vLLM >= 0.23", (9, 0),
                                None),
                               ("Hopper with vLLM 0.19.1 to 0.22.x", (9, 0), "0.22.0")):
        cmd = vllm_command(out, compute_capability=cc, vllm_version=version)
        argv = [model_ref if a == str(out) else a for a in cmd.argv]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(cmd.env.items()))
        commands.append((label, (env + " " if env else "") + shlex.join(argv)))
    return {"qrows": qrows, "krows": krows, "bpw": bpw, "weights_out": weights_out, "commands": commands,
            "weight_files": nv["weight_files"],
            "act": "W4A4: weights and linear inputs in NVFP4, with calibrated input scales" if nv["w4a4"]
            else "W4A16: NVFP4 weights, bf16 activations (no calibration)", "ignore": nv["ignore"]}


def _int8_body(i8: dict) -> dict:
    m = i8["manifest"]
    qz = m.quantization or {}
    plan = m.memory_plan or {}
    prow = []
    for key, label in (("experts", "experts"), ("lm_head", "lm_head (vocabulary-sharded)"), ("dense_mlp", "dense MLP"),
                       ("attention", "attention"), ("norms_and_routers", "norms and routers"),
                       ("embedding", "embedding on device"), ("kv_cache", "KV cache")):
        if key in plan:
            prow.append([label, _size(plan[key]), (plan.get("layout") or {}).get(key, "")])
    inputs = plan.get("inputs") or {}
    summary = []
    if plan:
        summary.append(f"total per rank {_size(plan.get('total_per_rank'))} of {_size(plan.get('device_mem_per_rank'))} "
                       f"per NeuronCore on {inputs.get('target')}: "
                       f"{'FITS' if plan.get('fits') else 'DOES NOT FIT'} (margin {_size(plan.get('margin'))}; "
                       f"KV cache for {inputs.get('seq_len')} tokens x batch {inputs.get('batch')})")
        if plan.get("host_ram") is not None:
            summary.append(f"host RAM to load every rank file at once: {_size(plan.get('host_ram_need'))} of "
                           f"{_size(plan.get('host_ram'))}: {'fits' if plan.get('host_fits') else 'DOES NOT FIT'}")
    return {"tp": m.tp_degree, "quantized": qz.get("quantized", []), "kept": qz.get("kept_bf16", []),
            "not_exported": qz.get("not_exported", []), "scale": qz.get("scale", ""),
            "bpw": i8["qbytes"] * 8 / max(i8["numel"], 1), "rank_rows": [[f, _size(b)] for f, b in i8["rank_bytes"]],
            "host_bytes": i8["host_bytes"], "plan_rows": prow, "plan_summary": summary,
            # results made before g4 cited public sources have local spec paths in their notes
            "plan_notes": [re.sub(r"\s*\(\.\./shared/[^)]*\)", "", n) for n in plan.get("notes", [])], "embed_scale": m.embed_scale, "layout": m.format}


def _verification_body(v: dict | None) -> dict | None:
    if v is None:
        return None
    o = v.get("overall") or {}
    if v.get("stale"):
        result = f"NOT VALID FOR THESE FILES: {v['stale']}; run g4serve check again"
        v = {**v, "passed": False}
    else:
        result = ("PASS" if v.get("passed") else "FAIL") + f" (min token agreement {v.get('min_agreement')})"
    rows = [["result", result],
            ["backend", v.get("backend")], ["format", v.get("format")], ["prompts", o.get("prompts")],
            ["greedy token agreement", o.get("token_agreement")],
            ["prompts with identical replies", o.get("exact_match_prompts")]]
    if o.get("facts_total"):
        rows.append(["facts answered", f"{o.get('facts_correct')} / {o.get('facts_total')}"])
    checks = v.get("chat_checks") or []
    if checks:
        ok = sum(1 for c in checks if c.get("ok"))
        bad = [f"thinking={c.get('thinking')} stream={c.get('stream')}: {c.get('problem')}" for c in checks
               if not c.get("ok")]
        rows.append(["chat API checks (thinking on/off, streaming on/off)",
                     f"{ok} / {len(checks)} ok" + (f"; {'; '.join(bad)}" if bad else "")])
    prompts = [[p.get("prompt", "")[:80], p.get("token_agreement"),
                "none (replies agree)" if p.get("first_divergence") is None else p["first_divergence"]]
               for p in (v.get("prompts") or [])[:_MAX_PROMPT_ROWS]]
    return {"table": _table(["check", "result"], rows), "backend": v.get("backend"), "passed": bool(v.get("passed")),
            "prompts": _table(["prompt", "token agreement", "first divergence"], prompts) if prompts else None,
            "more": max(len(v.get("prompts") or []) - _MAX_PROMPT_ROWS, 0)}


_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ intro }}

{% if fmt == "nvfp4" -%}
Format: NVIDIA Model Optimizer (modelopt) NVFP4 checkpoint, {{ nv.act }}.
Every quantized linear stores `weight` (uint8, two E2M1 codes per byte), `weight_scale`
(float8_e4m3fn, one per 16 weights), `weight_scale_2` (float32 global scale){% if nv.act.startswith("W4A4") %}
and `input_scale` (float32){% endif %}; MoE experts are stored as per-expert `gate_proj` /
`up_proj` / `down_proj` linears.

## What was quantized

{{ quant_table }}

Bits per quantized weight: **{{ "%.3f"|format(nv.bpw) }}** (E2M1 codes, fp8 block scales and fp32 scales together).

Kept as in the source:

{{ kept_table }}

Modules listed as not quantized in `config.json` (`quantization_config.ignore`): {{ nv.ignore|join(", ") or "none" }}.
{%- else -%}
Format: AWS Neuron (neuronx-distributed) int8 weights with fp32 per-output-channel scales
({{ i8.scale }}), pre-sharded for tensor parallelism over **{{ i8.tp }} NeuronCores**
(`weights/tp{rank}_sharded_checkpoint.safetensors`, layout `{{ i8.layout }}`); the token
embedding stays on the host (`embed_tokens.safetensors`, unscaled; the runtime multiplies by
`embed_scale` = {{ i8.embed_scale }}). `manifest.json` describes the layout.

## What was quantized

- int8: {{ i8.quantized|join(", ") }}
- kept bf16: {{ i8.kept|join(", ") }}
{% if i8.not_exported %}- not exported (text-only serving): {{ i8.not_exported|join(", ") }}
{% endif %}
Bits per int8 weight, scales included: **{{ "%.3f"|format(i8.bpw) }}**.
{%- endif %}

## Size

{{ size_table }}

GB = 10^9 bytes, MB = 10^6, kB = 10^3.

{% if fmt == "int8-neuron" -%}
## Memory plan per TP rank

{{ plan_table }}

{% for line in i8.plan_summary %}- {{ line }}
{% endfor %}{% for note in i8.plan_notes %}- {{ note }}
{% endfor %}
{% endif -%}
## Verification

{% if verification -%}
From `verification.json` (`g4serve check`, backend `{{ verification.backend }}`):

{{ verification.table }}
{% if verification.prompts %}
{{ verification.prompts }}
{% if verification.more %}
({{ verification.more }} more prompts in `verification.json`.)
{% endif %}{% endif %}
{%- else -%}
Not verified yet: there is no `verification.json` (written by `g4serve check`).
{%- endif %}

## Serve it

{% if fmt == "nvfp4" -%}
With vLLM (0.19.1 or newer; the flags `g4serve` uses{% if not vllm_verified %}; this checkpoint has not been loaded in vLLM by g4 yet{% endif %}):

{% for label, cmd in nv.commands %}{{ label }}:

```bash
{{ cmd }}
```

{% endfor %}
{%- else -%}
On an inf2 instance with AWS Neuron SDK 2.28 (NxD Inference 0.8), with g4 installed:

```bash
{{ neuron_commands }}
```

{% if not neuron_verified %}This int8-neuron result has not yet run on Inferentia2 hardware: its rank files were checked
by g4's CPU tensor-parallel emulator only.
{% endif %}
{% endif -%}
## How it was made

With g4 {{ g4_version }}:

```bash
{{ how }}
```

## Files

{{ files_table }}
"""


def render_card(out: str | Path, *, repo_id: str | None = None, name: str | None = None,
                base_model: str | None = None) -> str:
    """The model card text of the g4 result in ``out`` (deterministic: the same files and
    ``repo_id`` give the same bytes).

    Args:
        out: a g4 result directory (with ``g4_conversion.json``).
        repo_id: the Hub repo it is pushed to; the serve commands then name it. Default:
            the directory, by its name ``name`` (default ``out``'s name).
        base_model: overrides the facts' ``base_model`` (for a dry run; nothing is written).

    Raises:
        CardError: OUT has no or unreadable facts, headers or verification file.
    """
    from huggingface_hub import ModelCard

    out = Path(out)
    facts = load_conversion_facts(out)
    if base_model is not None:
        facts["base_model"] = check_repo_id(base_model, what="--base-model")
    if repo_id is not None:
        check_repo_id(repo_id)
    name = name or out.name
    title = repo_id.split("/", 1)[1] if repo_id else name
    fmt = facts["format"]
    src = facts["source"]
    base = facts.get("base_model") or src.get("repo_id")
    src_link = _hub_link(base, src["name"] if src["name"] != "embedded" else "gemma4-tiny (embedded in g4)")
    verification = _verification_body(_verification(out))
    files = repo_files(out)
    ctx = {"title": title, "fmt": fmt, "g4_version": facts.get("g4_version"), "how": _how_made(facts, name),
           "verification": verification,
           "files_table": _table(["file", "size"], [[f"`{f}`", _size(s)] for f, s in files] + [["`README.md`",
                                                                                              "this card"]])}
    source_bytes = src.get("weight_bytes")
    if fmt == NVFP4:
        nv = _nvfp4_body(out, facts, repo_id or f"./{name}", _nvfp4_facts(out))
        ctx["nv"] = nv
        ctx["intro"] = (f"{src_link} quantized to NVFP4 for vLLM by [g4](#how-it-was-made), "
                        f"preset `{facts['options'].get('preset', 'default')}`.")
        ctx["quant_table"] = _table(["quantized to NVFP4", "linears", "where"], nv["qrows"])
        ctx["kept_table"] = _table(["kept", "tensors", "dtype", "size"], nv["krows"])
        ctx["size_table"] = _table(["weights (files on disk)", "size", "vs source"], [
            [f"source ({src.get('dtype') or 'unknown dtype'}, {_n(len(src.get('weight_files') or []), 'file')})",
             _size(source_bytes), "1.000x"],
            [f"this checkpoint ({_n(len(nv['weight_files']), 'safetensors file')})", _size(nv["weights_out"]),
             f"{nv['weights_out'] / source_bytes:.3f}x" if source_bytes else "n/a"]])
        ctx["vllm_verified"] = bool(verification and verification["backend"] == "vllm" and verification["passed"])
    else:
        i8_facts = _int8_facts(out)
        i8 = _int8_body(i8_facts)
        ctx["i8"] = i8
        ctx["intro"] = (f"{src_link} converted to int8 for AWS Inferentia2 (NeuronCores, TP={i8['tp']}) by "
                        f"[g4](#how-it-was-made).")
        rank_total = sum(b for _, b in i8_facts["rank_bytes"])
        ctx["size_table"] = _table(["weights (files on disk)", "size"], [
            [f"source ({src.get('dtype') or 'unknown dtype'}, {_n(len(src.get('weight_files') or []), 'file')})",
             _size(source_bytes)]] + [[f"`{f}` (one TP rank)", s] for f, s in i8["rank_rows"]] + [
            ["all rank files", _size(rank_total)], ["`embed_tokens.safetensors` (host)", _size(i8["host_bytes"])]])
        ctx["plan_table"] = _table(["per rank", "bytes", "layout"], i8["plan_rows"]) if i8["plan_rows"] else \
            "No memory plan in `manifest.json` (converted without `--target`)."
        local = title
        ctx["neuron_commands"] = "\n".join(
            ([shlex.join(["hf", "download", repo_id, "--local-dir", local])] if repo_id else []) +
            [shlex.join(["g4serve", local if repo_id else f"./{name}", "--backend", "neuron"])])
        ctx["neuron_verified"] = bool(verification and verification["backend"] == "neuron" and verification["passed"])
    card = ModelCard.from_template(_card_data(facts, repo_id), template_str=_TEMPLATE, **ctx)
    text = card.content
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"
    return text
