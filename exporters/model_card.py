"""The model card (``README.md``) of a g4 result: a pure rendering of its inputs.

:func:`render_card` turns a :class:`CardInputs` (the conversion facts, the NVFP4 or
int8-neuron contents, ``verification.json``, ``eval.json``, the file list with sizes, the repo id) into
the card text; it reads no file. ``g4.convert.card`` gathers those inputs from OUT (and, at
conversion time, from the source) and writes the card, so ``g4convert push`` can re-render it
later, e.g. after ``g4serve check`` added ``verification.json``.

The same inputs always give the same bytes: no timestamps, no absolute paths, every listing
sorted. Metadata go through huggingface_hub's ``ModelCardData`` / ``ModelCard`` (front matter
keys as in huggingface_hub ``repocard_data.py``; ``base_model_relation: quantized`` as the
Hub's model tree reads it).

``g4_conversion.json`` (version 1; checked by :func:`check_facts`)::

    {"g4_conversion": 1, "format": "nvfp4" | "int8-neuron", "g4_version": "0.1.0",
     "base_model": "org/name" | null,
     "source": {"name", "repo_id" | null, "revision" (HF cache commit) | null, "weight_bytes", "weight_files",
                "dtype" (the stored dtypes of its tensors, e.g. "bfloat16" or "bfloat16, float32"),
                "card": {license, license_name, license_link, library_name, tags,
                         pipeline_tag, language} (only keys the source README has),
                "synthetic": {"layers", "seed"} (only for a source `g4convert synth` wrote)},
     "options": {...the result-affecting options of the conversion...}}
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from g4.core.errors import G4Error
from g4.core.sizes import format_bytes

FACTS_FILE = "g4_conversion.json"
CARD_FILE = "README.md"
VERIFICATION_FILE = "verification.json"
EVAL_FILE = "eval.json"  # g4convert eval (g4.convert.evaluate)
EVAL_VERSION = 1
FACTS_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
NVFP4, INT8_NEURON = "nvfp4", "int8-neuron"

FORMAT_TAGS = {NVFP4: ["nvfp4", "modelopt", "vllm"], INT8_NEURON: ["neuron", "inferentia2", "int8"]}
# Front matter keys copied from the source README (huggingface_hub ModelCardData fields).
SOURCE_CARD_KEYS = ("license", "license_name", "license_link", "library_name", "pipeline_tag", "language", "tags")
_MAX_PROMPT_ROWS = 10


# The serve commands a card shows: (label, GPU compute capability, vLLM version or None for the
# latest known); the commands themselves come from g4.exporters.vllm_command.
VLLM_TARGETS = (("Blackwell (compute capability 10.0, W4A4 FP4 kernels)", (10, 0), None),
                ("Hopper (compute capability 9.0, weight-only Marlin kernels), vLLM >= 0.23", (9, 0), None),
                ("Hopper with vLLM 0.19.1 to 0.22.x", (9, 0), "0.22.0"))


class CardError(G4Error):
    """OUT lacks what its model card needs (not a g4 result, unreadable facts)."""


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



def check_facts(facts, where: str) -> dict:
    """Return ``facts`` if it is a ``g4_conversion.json`` of version :data:`FACTS_VERSION`.

    Raises:
        CardError: anything else (``where`` names the file).
    """
    if not isinstance(facts, dict) or facts.get("g4_conversion") != FACTS_VERSION or facts.get("format") not in FORMAT_TAGS:
        raise CardError(f"{where}: not a g4_conversion version {FACTS_VERSION} file")
    return facts


@dataclass(frozen=True)
class CardInputs:
    """Everything a model card shows (gathered by ``g4.convert.card.card_inputs``).

    Attributes:
        facts: ``g4_conversion.json`` (schema above); the source's card data is
            ``facts["source"]["card"]``, a ``base_model`` override is already applied.
        name: OUT's directory name (the title, and the local path until pushed).
        files: ``(path relative to OUT, size in bytes)`` of every repo file but ``README.md``, sorted.
        verification: ``verification.json`` (``g4serve check``, ``g4_verification: 1``) with
            ``"stale"`` added (why it is not about OUT's current weights, or None); None when absent.
        evaluation: ``eval.json`` (``g4convert eval``, ``g4_eval: 1``) with ``"stale"`` added, as
            for ``verification``; None when absent.
        repo_id: the Hub repo the card is for (the serve commands then name it), or None.
        nvfp4: for an NVFP4 result: ``quant`` ({kind: {"linears", "layers" (set), "experts"
            (set)}}), ``kept`` ({kind: {"tensors", "dtypes" (set of safetensors dtypes), "bytes"}}),
            ``params`` (quantized parameters), ``qbytes`` (their codes and scales, bytes),
            ``w4a4``, ``ignore`` (exclusion list), ``weight_files``, ``weights_out`` (bytes),
            ``model_dir`` and ``commands`` ([(label, VllmCommand for model_dir)], :data:`VLLM_TARGETS`).
        int8: for an int8-neuron result: ``manifest`` (``g4.exporters.neuron_int8.Manifest``),
            ``int8_tensors``, ``numel`` and ``qbytes`` (int8 weights of rank 0 with their
            scales, bytes), ``rank_bytes`` ([(file, bytes)]), ``host_bytes``.
    """

    facts: dict
    name: str
    files: list[tuple[str, int]]
    verification: dict | None = None
    repo_id: str | None = None
    evaluation: dict | None = None
    nvfp4: dict | None = None
    int8: dict | None = None


# --------------------------------------------------------------------------- rendering


def _size(n: int | float | None) -> str:
    """:func:`~g4.core.sizes.format_bytes`, or "unknown"."""

    return "unknown" if n is None else format_bytes(n)


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
        argv = ["g4convert", "nvfp4", src_arg, out_name, "--preset", o.get("preset", "default"),
                "--algorithm", o.get("algorithm", "max")]  # results before --algorithm existed used max
        if o.get("weight_only"):
            argv.append("--weight-only")
        if not o.get("weight_only") or o.get("kv_cache_dtype", "auto") != "auto" or o.get("algorithm") == "gptq":  # calibrated
            argv += _calibration_argv(o)
        if o.get("kv_cache_dtype", "auto") != "auto":
            argv += ["--kv-cache-dtype", str(o["kv_cache_dtype"])]
        argv += ["--max-shard-size", str(o.get("max_shard_size"))]
    else:
        argv = ["g4convert", "int8-neuron", src_arg, out_name, "--tp", str(o.get("tp"))]
        if o.get("quantize_attention"):
            argv.append("--quantize-attention")
        if o.get("target"):
            argv += ["--target", str(o["target"])]
        if o.get("force"):
            argv.append("--force")
        argv += ["--algorithm", o.get("algorithm", "max")]  # results before --algorithm existed used max
        if o.get("algorithm") == "gptq":  # the only int8 algorithm that calibrates
            argv += _calibration_argv(o)
    return shlex.join(argv)


def _calibration_argv(o: dict) -> list[str]:
    """The calibration options of a conversion's recorded ``options``, as g4convert takes them."""
    argv = ["--calib-data", o["calib_data"]["name"]] if o.get("calib_data") else []
    return argv + ["--calib-samples", str(o.get("calib_samples")), "--calib-seq-len", str(o.get("calib_seq_len")),
                   "--calib-dtype", str(o.get("calib_dtype"))]


def _nvfp4_body(facts: dict, model_ref: str, nv: dict) -> dict:
    order = ("experts", "dense MLP", "attention", "other")
    qrows = []
    for kind in sorted(nv["quant"], key=lambda k: order.index(k) if k in order else len(order)):
        q = nv["quant"][kind]
        where = _count(len(q["layers"]), "layer") + (f" x {_count(len(q['experts']), 'expert')}" if q["experts"] else "")
        qrows.append([kind, q["linears"], where])
    krows = [[k, v["tensors"], ", ".join(sorted(v["dtypes"])), _size(v["bytes"])] for k, v in sorted(nv["kept"].items())]
    bpw = nv["qbytes"] * 8 / max(nv["params"], 1)
    weights_out = nv["weights_out"]
    commands = []
    for label, cmd in nv["commands"]:
        argv = [model_ref if a == nv["model_dir"] else a for a in cmd.argv]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(cmd.env.items()))
        commands.append((label, (env + " " if env else "") + shlex.join(argv)))
    return {"qrows": qrows, "krows": krows, "bpw": bpw, "weights_out": weights_out, "commands": commands,
            "weight_files": nv["weight_files"],
            "act": "W4A4: weights and linear inputs in NVFP4, with calibrated input scales" if nv["w4a4"]
            else "W4A16: NVFP4 weights, bf16 activations (no calibration)", "ignore": nv["ignore"],
            "kv_cache": nv.get("kv_cache", False)}


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
            summary.append(f"host RAM of the load (anonymous memory, page cache kept, OS/runtime allowance; the "
                           f"rank files are memory-mapped): {_size(plan.get('host_ram_need'))} of "
                           f"{_size(plan.get('host_ram'))}: {'fits' if plan.get('host_fits') else 'DOES NOT FIT'}")
    return {"tp": m.tp_degree, "quantized": qz.get("quantized", []), "kept": qz.get("kept_bf16", []),
            "not_exported": qz.get("not_exported", []), "scale": qz.get("scale", ""),
            # results written before --algorithm existed rounded to nearest
            "algorithm": qz.get("algorithm", "max"), "algorithm_detail": qz.get("algorithm_detail", ""),
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


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _eval_body(e: dict | None) -> dict | None:
    """The card's table of ``eval.json`` (llama.cpp's statistics, ± one standard error)."""
    if e is None:
        return None
    u, k = e.get("uncertainty") or {}, e.get("kld") or {}
    against = e.get("against") or {}
    src = against.get("repo_id") and f"{against['repo_id']}@{str(against.get('revision'))[:12]}" or against.get("name")
    text = e.get("text") or {}
    rows = [["PPL(source)", f"{_num(e.get('ppl_src'), '.4f')} ± {_num(u.get('ppl_src'), '.4f')}"],
            ["PPL(this checkpoint)", f"{_num(e.get('ppl_out'), '.4f')} ± {_num(u.get('ppl_out'), '.4f')}"],
            ["PPL ratio", f"{_num(e.get('ppl_ratio'), '.6f')} ± {_num(u.get('ppl_ratio'), '.6f')}"],
            ["mean KLD (nats)", f"{_num(k.get('mean'), '.6f')} ± {_num(u.get('kld_mean'), '.6f')}"],
            ["median KLD", _num(k.get("median"), ".6f")], ["90% KLD", _num(k.get("p90"), ".6f")],
            ["99% KLD", _num(k.get("p99"), ".6f")], ["99.9% KLD", _num(k.get("p999"), ".6f")],
            ["max KLD", _num(k.get("max"), ".6f")],
            ["same top token", f"{_num(100 * e['top1_agreement'] if e.get('top1_agreement') is not None else None, '.3f')}"
                               f" ± {_num(100 * u['top1_agreement'] if 'top1_agreement' in u else None, '.3f')} %"],
            ["RMS Δp", f"{_num(100 * e['rms_dp'] if e.get('rms_dp') is not None else None, '.3f')}"
                       f" ± {_num(100 * u['rms_dp'] if 'rms_dp' in u else None, '.3f')} %"]]
    how = (f"{e.get('tokens')} tokens of `{text.get('file')}` scored ({e.get('chunks')} chunks of {e.get('ctx')} "
           f"tokens, the second half of each, as llama.cpp `perplexity --kl-divergence`), against `{src}`, "
           f"{e.get('detail')}{', W4A4 activation emulation' if e.get('act_quant') else ''}, {e.get('dtype')}")
    return {"table": _table(["statistic", "value"], rows), "how": how,
            "stale": f"NOT VALID FOR THESE FILES: {e['stale']}; run g4convert eval again" if e.get("stale") else None}


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
{% if nv.kv_cache %}
KV cache: FP8 (E4M3), with a calibrated float32 `k_scale` / `v_scale` per decoder layer
(amax / 448 of the keys and values, modelopt's `kv_cache_quant_algo: FP8`); serve with
`--kv-cache-dtype fp8`.
{% else %}
KV cache: no KV cache scales (bf16 KV cache; `--kv-cache-dtype fp8` would use 1.0).
{% endif %}
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
- int8 codes: `{{ i8.algorithm }}`{% if i8.algorithm_detail %} ({{ i8.algorithm_detail }}){% endif %}
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

## Quality on held-out text

{% if evaluation -%}
From `eval.json` (`g4convert eval`): {{ evaluation.how }}.
{% if evaluation.stale %}
**{{ evaluation.stale }}**
{% endif %}
{{ evaluation.table }}
{%- else -%}
Not evaluated yet: there is no `eval.json` (written by `g4convert eval`).
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


def _synthetic_note(src: dict) -> str:
    """The card's warning for a source ``g4convert synth`` wrote (``source.synthetic``), else ``""``."""
    synth = src.get("synthetic")
    if synth is None:
        return ""
    made = ", ".join(f"{v} {k}" if k == "layers" else f"{k} {v}" for k, v in
                     (("layers", synth.get("layers")), ("seed", synth.get("seed"))) if v is not None)
    return ("\n\n**Synthetic source, random weights: not a usable model.** The source was written by "
            f"`g4convert synth`{f' ({made})' if made else ''}: the real model's tensor names, shapes and dtypes "
            "with random values, for benchmarks and dry runs of the conversion. What this checkpoint generates "
            "means nothing.")


def render_card(inputs: CardInputs) -> str:
    """The model card text of a g4 result (deterministic: the same inputs give the same bytes;
    no file is read).

    Raises:
        CardError: ``inputs.repo_id`` is not a Hub repo id.
    """
    from huggingface_hub import ModelCard

    facts, repo_id, name = inputs.facts, inputs.repo_id, inputs.name
    if repo_id is not None:
        check_repo_id(repo_id)
    title = repo_id.split("/", 1)[1] if repo_id else name
    fmt = facts["format"]
    src = facts["source"]
    base = facts.get("base_model") or src.get("repo_id")
    src_link = _hub_link(base, src["name"] if src["name"] != "embedded" else "gemma4-tiny (embedded in g4)")
    verification = _verification_body(inputs.verification)
    files = inputs.files
    ctx = {"title": title, "fmt": fmt, "g4_version": facts.get("g4_version"), "how": _how_made(facts, name),
           "verification": verification, "evaluation": _eval_body(inputs.evaluation),
           "files_table": _table(["file", "size"], [[f"`{f}`", _size(s)] for f, s in files] + [["`README.md`",
                                                                                              "this card"]])}
    source_bytes = src.get("weight_bytes")
    if fmt == NVFP4:
        nv = _nvfp4_body(facts, repo_id or f"./{name}", inputs.nvfp4)
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
        i8_facts = inputs.int8
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
    ctx["intro"] += _synthetic_note(src)
    card = ModelCard.from_template(_card_data(facts, repo_id), template_str=_TEMPLATE, **ctx)
    text = card.content
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"
    return text
