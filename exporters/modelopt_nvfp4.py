"""modelopt NVFP4 checkpoint metadata, and the checker every export passes before it is placed.

Metadata formats (as written by
Model-Optimizer ``modelopt/torch/export/unified_export_hf.py`` and
``convert_hf_config.py``; read by vLLM ``ModelOptQuantConfigBase.from_config``):

- ``hf_quant_config.json``: ``{"producer", "quantization": {"quant_algo": "NVFP4",
  "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": [...]}}``;
  vLLM requires all three of group_size, kv_cache_quant_algo, exclude_modules.
- ``config.json["quantization_config"]`` (read first by vLLM): ``quant_method: modelopt``,
  ``quant_algo: NVFP4``, ``ignore`` (same list), ``config_groups`` with 4-bit float
  weights and, for W4A4, input activations, group size 16.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from g4.convert.checkpoint import Checkpoint
from g4.convert.errors import ExportError
from g4.convert.gemma4 import MODEL_MODULE_KINDS, is_tied
from g4.exporters.nvfp4_names import (
    DENSE_GROUPS,
    QUANT_SUFFIXES,
    OutputName,
    expert_module,
    parse_output_name,
)
from g4.quantizers.nvfp4 import BLOCK_SIZE

MODELOPT_COMPAT_VERSION = "0.47.0"
CONVERTER = {"name": "g4", "version": "0.1.0"}


def _quant_args() -> dict:
    return {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}


def quantization_config(excludes: list[str], *, weight_only: bool) -> dict:
    """``config.json["quantization_config"]`` for NVFP4 (W4A16 omits ``input_activations``)."""
    group = {"weights": _quant_args(), "targets": ["Linear"]}
    if not weight_only:
        group["input_activations"] = _quant_args()
    return {
        "config_groups": {"group_0": group},
        "ignore": list(excludes),
        "quant_algo": "NVFP4",
        "producer": {"name": "modelopt", "version": MODELOPT_COMPAT_VERSION},
        "converter": dict(CONVERTER),
        "quant_method": "modelopt",
    }


def hf_quant_config(excludes: list[str]) -> dict:
    """Legacy ``hf_quant_config.json`` contents."""
    return {
        "producer": {"name": "modelopt", "version": MODELOPT_COMPAT_VERSION},
        "converter": dict(CONVERTER),
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": BLOCK_SIZE,
                         "exclude_modules": list(excludes)},
    }


def write_metadata(out_dir: Path, src_config: dict, *, excludes: list[str], weight_only: bool) -> None:
    """Write ``config.json`` (the source's in the release form, with ``quantization_config``
    added; never re-serialised through transformers, which would drop release keys such as
    ``global_head_dim``) and ``hf_quant_config.json``.

    Raises:
        G4Error: a ``per_layer_config`` the release form cannot express
            (:func:`g4.convert.gemma4.release_config`).
    """
    from g4.convert.gemma4 import release_config

    config = release_config(src_config)
    config["quantization_config"] = quantization_config(excludes, weight_only=weight_only)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(excludes), indent=2) + "\n")


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(module.startswith(p[:-1]) if p.endswith("*") else module == p for p in patterns)


def check_export(out_dir: str | Path, *, label: str | Path | None = None) -> dict[str, int]:
    """Check an NVFP4 output directory against the rules vLLM depends on.

    Checks: no fused 3-D expert tensor and no ``.moe.`` / compressed-tensors names
    (P01, P03); every quantized module has exactly ``weight`` uint8 ``[out, in/2]``,
    ``weight_scale`` fp8 ``[out, in/16]``, ``weight_scale_2`` f32 ``[]`` and, iff the
    config declares input activations, ``input_scale`` f32 ``[]`` (P05); every scale
    finite and > 0 (P04); one ``weight_scale_2`` per expert gate/up pair and per dense
    q/k/v and gate/up group, one ``input_scale`` per dense group (vLLM keeps one per merged layer:
    vllm-project/vllm ``vllm/model_executor/layers/quantization/modelopt.py``); the
    exclusion list matches the tensors (P07): no quantized module is excluded, every
    bf16 2-D linear weight is, every pattern matches something (``lm_head`` when tied).

    Args:
        label: the name used for the directory in error messages (the final OUT when
            checking its temporary directory).

    Returns:
        ``{"quantized_modules": n, "kept_tensors": m}``.

    Raises:
        ExportError: naming the first offending tensor.
    """
    out_dir = Path(out_dir)
    label = label or out_dir
    config = json.loads((out_dir / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    hq = json.loads((out_dir / "hf_quant_config.json").read_text())["quantization"]
    excludes = qc.get("ignore", [])
    if excludes != hq.get("exclude_modules"):
        raise ExportError(f"{label}: config.json ignore and hf_quant_config.json exclude_modules differ")
    for key, want in (("quant_algo", "NVFP4"), ("group_size", BLOCK_SIZE)):
        if hq.get(key) != want:
            raise ExportError(f"{label}: hf_quant_config.json {key} is {hq.get(key)!r}, expected {want!r}")
    w4a4 = any("input_activations" in g for g in qc.get("config_groups", {}).values())
    modules: dict[str, dict[str, tuple]] = defaultdict(dict)
    kept: dict[str, tuple] = {}
    ckpt = Checkpoint(out_dir)  # the same header/index validation as any source
    parsed: dict[str, OutputName] = {}
    for name, info in ckpt.tensors.items():
        o = parse_output_name(name)
        if o is None:  # fused 3-D experts, .moe., compressed-tensors or any name the table does not write
            raise ExportError(f"tensor {name}: name vLLM does not load for modelopt NVFP4 (fused, .moe. or "
                              "compressed-tensors, or not in the name table)")
        parsed[name] = o
        if o.suffix in QUANT_SUFFIXES:
            modules[o.module][o.suffix] = (info.dtype, info.shape)
        kept[name] = (info.dtype, info.shape)
    quantized = {m: t for m, t in modules.items() if t.get("weight", (None,))[0] == torch.uint8}
    expected = set(QUANT_SUFFIXES) if w4a4 else set(QUANT_SUFFIXES[:3])
    value = ckpt.get

    scalars: dict[str, torch.Tensor] = {}
    for module, ts in sorted(quantized.items()):
        if set(ts) != expected:
            raise ExportError(f"module {module}: has {sorted(ts)}, expected {sorted(expected)} "
                              f"({'W4A4' if w4a4 else 'W4A16'} per config.json)")
        out_f, half = ts["weight"][1]
        if ts["weight_scale"] != (torch.float8_e4m3fn, (out_f, half * 2 // BLOCK_SIZE)):
            raise ExportError(f"tensor {module}.weight_scale: {ts['weight_scale']} does not fit weight [{out_f}, {half}]")
        for s in expected - {"weight", "weight_scale"}:
            if ts[s] != (torch.float32, ()):
                raise ExportError(f"tensor {module}.{s}: {ts[s]}, expected float32 []")
            v = value(f"{module}.{s}")
            if not (torch.isfinite(v) and v > 0):
                raise ExportError(f"tensor {module}.{s}: {v.item()} is not finite and > 0")
            scalars[f"{module}.{s}"] = v
        bs = value(f"{module}.weight_scale").float()
        if not (torch.isfinite(bs).all() and (bs > 0).all()):
            raise ExportError(f"tensor {module}.weight_scale: has non-finite or non-positive block scales")
        if _excluded(module, excludes):
            raise ExportError(f"module {module}: is quantized but matches the exclusion list")
        for name in (f"{module}.{s}" for s in ts):
            kept.pop(name)
    _check_shared({m: parsed[f"{m}.weight"] for m in quantized}, scalars, w4a4)
    for name, (dtype, shape) in kept.items():
        o = parsed[name]
        if len(shape) == 2 and o.suffix == "weight" and o.kind != MODEL_MODULE_KINDS["embed_tokens"] \
                and not _excluded(o.module, excludes):
            raise ExportError(f"tensor {name}: kept {dtype} but its module is not in the exclusion list")
    tied = is_tied(config)
    for p in excludes:
        if p == "lm_head" and tied:
            continue
        if not any(_excluded(n.rpartition(".")[0], [p]) for n in kept):
            raise ExportError(f"{label}: exclusion pattern {p!r} matches no tensor in the checkpoint")
    return {"quantized_modules": len(quantized), "kept_tensors": len(kept)}


def _check_shared(quantized: dict[str, OutputName], scalars: dict[str, torch.Tensor], w4a4: bool) -> None:
    """Fused partners must carry identical global (and input) scales: an expert's gate and up,
    and every multi-member dense group of the table (q/k/v, gate/up)."""
    groups = []
    for module, o in quantized.items():
        if o.expert is not None and o.proj == "gate_proj":
            groups.append((module, expert_module(o.layer_prefix, o.expert, "up_proj")))
        elif o.expert is None and o.layer_prefix is not None:
            for g in DENSE_GROUPS:
                if len(g.members) > 1 and module == o.layer_prefix + g.members[0]:
                    groups.append(tuple(o.layer_prefix + m for m in g.members
                                        if o.layer_prefix + m in quantized or m not in g.optional))
    suffixes = ("weight_scale_2", "input_scale") if w4a4 else ("weight_scale_2",)
    for group in groups:
        for s in suffixes:
            vals = [scalars.get(f"{m}.{s}") for m in group]
            if any(v is None for v in vals) or any(not torch.equal(vals[0], v) for v in vals[1:]):
                raise ExportError(f"modules {', '.join(group)}: {s} differs inside a fused group (vLLM keeps one)")
