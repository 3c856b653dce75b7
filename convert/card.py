"""The model card (``README.md``) of a g4 result: its inputs gathered from the result's files,
and its rendering.

At conversion time :func:`write_model_card` stores the facts that only the source knows (its
name and Hub repo id, its weight bytes, its README front matter: license, tags, library and
pipeline) and the conversion options in ``g4_conversion.json``, then renders ``README.md``.
Everything else comes from OUT itself (:func:`card_inputs`), so ``g4convert push`` can re-render
the card later, e.g. after ``g4serve check`` added ``verification.json``:

- NVFP4: safetensors headers, classified by the output table
  (``g4.exporters.nvfp4_names.Nvfp4Layout``: which linears are ``uint8`` E2M1 with their
  scales, what stayed bf16, bits per quantized weight), ``config.json`` (``quantization_config``);
- int8-neuron: ``manifest.json`` (TP degree, what was quantized, memory plan) and the rank
  files' headers;
- ``verification.json`` when present (schema of ``g4serve check``: ``g4_verification: 1``);
- ``eval.json`` when present (``g4convert eval``: ``g4_eval: 1``).

:func:`render_card` turns a :class:`CardInputs` into the card text and reads no file. The same
inputs always give the same bytes: no timestamps, no absolute paths, every listing sorted.
Metadata go through huggingface_hub's ``ModelCardData`` / ``ModelCard`` (front matter keys as in
huggingface_hub ``repocard_data.py``; ``base_model_relation: quantized`` as the Hub's model tree
reads it).

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

import hashlib
import json
import re
import shlex
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from g4.convert.resolve import EMBEDDED_DIR, REPO_ID_PATTERN
from g4.core.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, weight_fingerprints
from g4.core.errors import G4Error, a_or_an
from g4.core.sizes import format_bytes
from g4.exporters.formats import CARD_FILE, EVAL_FILE, FACTS_FILE, INT8_NEURON, NVFP4, VERIFICATION_FILE
from g4.exporters.modelopt_nvfp4 import CONVERTER, declares_input_activations, declares_kv_cache, output_layout
from g4.exporters.neuron_int8 import COMPILED_STAMP, Manifest, parse_rank_name
from g4.exporters.nvfp4_names import Role
from g4.exporters.output_dir import SYNTH_MARKER, write_text_atomic
from g4.exporters.vllm_command import vllm_command

EVAL_VERSION = 1
FACTS_VERSION = 1
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


def describe_calls(calls: list[dict]) -> str:
    """``verification.json`` tool calls as ``name({"arg": ...}), ...`` (``""`` for none), as
    ``g4serve check`` prints them and the card lists the wrong ones."""
    return ", ".join(f"{c.get('name')}({json.dumps(c.get('arguments'))})" for c in calls)


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
    if o.get("tool_calls_total"):
        bad = [f"{t.get('question')!r} -> " + (describe_calls(t.get("calls") or []) or repr(t.get("content")))
               for t in v.get("tool_calls") or [] if not t.get("ok")]
        rows.append(["tool calls (expected function and arguments)",
                     f"{o.get('tool_calls_correct')} / {o.get('tool_calls_total')}" + (f"; {'; '.join(bad)}" if bad else "")])
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
    write_text_atomic(tmp / CARD_FILE, card_text(tmp, name=out_name, facts=facts, layout=layout))


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
    write_text_atomic(Path(out) / CARD_FILE, text)
    return text


def rerender_card(out: str | Path) -> None:
    """Re-render OUT's model card with its current ``verification.json`` / ``eval.json`` when OUT
    is a g4 result (has ``g4_conversion.json``); an edited card is left as it is (:func:`write_card`)."""
    if (Path(out) / FACTS_FILE).is_file():
        write_card(out)


def _write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


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
    config = json.loads((out / CONFIG_NAME).read_text())
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
    """:func:`render_card` of :func:`card_inputs` (same arguments),
    ending in g4's sha256 line (:func:`edited_card`)."""
    return _stamped(render_card(card_inputs(out, **kw)))
