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
- FP8 KV cache (``--kv-cache-dtype fp8``): ``kv_cache_quant_algo: "FP8"`` in
  ``hf_quant_config.json`` and ``kv_cache_scheme: {"dynamic": false, "num_bits": 8, "type":
  "float"}`` in ``quantization_config`` (modelopt ``convert_hf_config.py``; vLLM reads either as
  FP8), with a float32 ``[]`` ``k_scale`` / ``v_scale`` per decoder layer
  (:data:`g4.exporters.nvfp4_names.KV_SCALE_MODULES`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from g4.core.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG, SOURCE_DTYPES, Checkpoint, read_json_object
from g4.core.errors import ExportError
from g4.core.gemma4 import LM_HEAD, is_tied, release_config, tower_of
from g4.exporters.nvfp4_names import DENSE_GROUPS, MODEL_KEEP, QUANT_ROLES, Nvfp4Layout, Part, Role
from g4.quantizers.nvfp4 import BLOCK_SIZE, E4M3_MAX_CODE, E4M3_MIN_POSITIVE_CODE

MODELOPT_COMPAT_VERSION = "0.47.0"
# g4convert nvfp4 --kv-cache-dtype: "auto" writes no KV cache scales, "fp8" modelopt's FP8 KV export.
KV_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_QUANT_ALGO = "FP8"  # hf_quant_config.json quantization.kv_cache_quant_algo
KV_CACHE_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}  # config.json quantization_config
CONVERTER = {"name": "g4", "version": "0.1.0"}


def _quant_args() -> dict:
    return {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}


def quantization_config(excludes: list[str], *, weight_only: bool, kv_cache: bool = False) -> dict:
    """``config.json["quantization_config"]`` for NVFP4 (W4A16 omits ``input_activations``;
    ``kv_cache``: FP8 KV cache, ``kv_cache_scheme``)."""
    group = {"weights": _quant_args(), "targets": ["Linear"]}
    if not weight_only:
        group["input_activations"] = _quant_args()
    kv = {"kv_cache_scheme": dict(KV_CACHE_SCHEME)} if kv_cache else {}
    return {
        "config_groups": {"group_0": group},
        "ignore": list(excludes),
        "quant_algo": "NVFP4",
        **kv,
        "producer": {"name": "modelopt", "version": MODELOPT_COMPAT_VERSION},
        "converter": dict(CONVERTER),
        "quant_method": "modelopt",
    }


def hf_quant_config(excludes: list[str], *, kv_cache: bool = False) -> dict:
    """Legacy ``hf_quant_config.json`` contents (``kv_cache_quant_algo`` ``"FP8"`` with ``kv_cache``,
    else null)."""
    return {
        "producer": {"name": "modelopt", "version": MODELOPT_COMPAT_VERSION},
        "converter": dict(CONVERTER),
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO if kv_cache else None,
                         "group_size": BLOCK_SIZE,
                         "exclude_modules": list(excludes)},
    }


def write_metadata(out_dir: Path, src_config: dict, *, excludes: list[str], weight_only: bool,
                   kv_cache: bool = False) -> None:
    """Write ``config.json`` (the source's in the release form, with ``quantization_config``
    added; never re-serialised through transformers, which would drop release keys such as
    ``global_head_dim``) and ``hf_quant_config.json``.

    Raises:
        G4Error: a ``per_layer_config`` the release form cannot express
            (:func:`g4.core.gemma4.release_config`).
    """
    config = release_config(src_config)
    config["quantization_config"] = quantization_config(excludes, weight_only=weight_only, kv_cache=kv_cache)
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant_config(excludes, kv_cache=kv_cache), indent=2)
                                                  + "\n")


def declares_input_activations(config: dict) -> bool:
    """W4A4: ``config.json``'s ``quantization_config`` (:func:`quantization_config`) quantizes
    linear inputs, so every quantized linear carries an ``input_scale``."""
    qc = config.get("quantization_config") or {}
    return any("input_activations" in g for g in (qc.get("config_groups") or {}).values())


def declares_kv_cache(config: dict) -> bool:
    """FP8 KV cache: ``config.json``'s ``quantization_config`` has modelopt's ``kv_cache_scheme``
    (:data:`KV_CACHE_SCHEME`), so every decoder layer carries a ``k_scale`` and ``v_scale``."""
    return (config.get("quantization_config") or {}).get("kv_cache_scheme") == KV_CACHE_SCHEME


def output_layout(ckpt: Checkpoint) -> Nvfp4Layout:
    """The output table (:class:`~g4.exporters.nvfp4_names.Nvfp4Layout`) of a finished NVFP4
    checkpoint ``ckpt`` (opened as a result, not a source), rebuilt from its ``config.json``.

    What OUT does not record in its metadata is read from its header: which dense parts are
    quantized (layer 0's ``q_proj`` / ``mlp.gate_proj`` stored as uint8; the experts always
    are), the towers present (:func:`~g4.exporters.nvfp4_names.tower_of`), and the dtypes of
    the kept tensors (as the source stored them: BF16, F16 or F32; any other dtype is expected
    as BF16, so that the checker names it). Names are the canonical (transformers) ones; a
    kept tensor's ``source`` is its own name.
    """
    arch, prefix, header = ckpt.arch, ckpt.prefix, ckpt.tensors
    layer_sources = [{sfx: f"{prefix}layers.{L}.{sfx}" for sfx in arch.layer_tensor_shapes(L)}
                     for L in range(arch.num_layers)]
    parts = {Part.EXPERTS}
    for g in DENSE_GROUPS:
        info = header.get(layer_sources[0].get(f"{g.members[0]}.weight", ""))
        if info is not None and info.dtype == torch.uint8:
            parts.add(g.part)
    towers = sorted(n for n in header if tower_of(n) is not None)
    shapes = {n: header[n].shape for n in towers}
    for L, src in enumerate(layer_sources):
        shapes |= {src[sfx]: shape for sfx, shape in arch.layer_tensor_shapes(L).items()}
    for rel, shape in arch.model_tensor_shapes().items():  # an untied lm_head.weight is top level
        shapes[rel if rel not in MODEL_KEEP else prefix + rel] = shape
    dtypes = {n: header[n].dtype if n in header and header[n].dtype in SOURCE_DTYPES else torch.bfloat16
              for n in shapes}
    return Nvfp4Layout.build(arch, prefix=prefix, parts=frozenset(parts), act_quant=declares_input_activations(ckpt.config),
                             layer_sources=layer_sources, model_sources=sorted([prefix + r for r in MODEL_KEEP] + towers),
                             lm_head=None if arch.tied else LM_HEAD, dtypes=dtypes, shapes=shapes,
                             kv_cache=declares_kv_cache(ckpt.config))


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(module.startswith(p[:-1]) if p.endswith("*") else module == p for p in patterns)


def _w4(act_quant: bool) -> str:
    return "W4A4" if act_quant else "W4A16"


def check_export(out_dir: str | Path, *, label: str | Path | None = None,
                 layout: Nvfp4Layout | None = None, values: bool = True) -> dict[str, int]:
    """Check an NVFP4 output directory against its output table and the rules vLLM depends on.

    The header is compared with the table (:class:`~g4.exporters.nvfp4_names.Nvfp4Layout`:
    the converter's own, or :func:`output_layout` rebuilt from OUT): a tensor the table does not
    list (fused 3-D experts, ``.moe.`` or compressed-tensors names: P01, P03), a quantized module
    without exactly ``weight`` / ``weight_scale`` / ``weight_scale_2`` and, iff the config declares
    input activations, ``input_scale`` (P05), a missing tensor, a wrong dtype or shape: one error
    line each; the FP8 KV cache scales iff ``kv_cache_scheme`` / ``kv_cache_quant_algo`` say so
    (both files agreeing). Then the values: every scale finite and > 0 (P04), KV cache scales
    too; one ``weight_scale_2`` per expert gate/up pair and per dense q/k/v and gate/up group,
    one ``input_scale`` per dense group
    (vLLM keeps one per merged layer: vllm-project/vllm
    ``vllm/model_executor/layers/quantization/modelopt.py``). Then the exclusion list (P07): no
    quantized module is excluded, every kept linear weight (and tower tensor) is, every pattern
    matches something (``lm_head`` when tied).

    Args:
        label: the name used for the directory in error messages (the final OUT when
            checking its temporary directory).
        layout: the table the output was written from (default: rebuilt from OUT).
        values: also read and check the scales (every ``weight_scale`` block and the scalar
            scales). ``False`` reads the safetensors headers and the JSON metadata only: the
            cheap check a finished result passes before verify, check, serve or push trust it
            (:func:`g4.exporters.formats.check_result`).

    Returns:
        ``{"quantized_modules": n, "kept_tensors": m}``.

    Raises:
        ExportError: naming the first offending tensor (and the file holding it), module or file.
        CheckpointError: unreadable metadata, or an index or shard header that does not hold
            together (:class:`~g4.core.checkpoint.Checkpoint`).
    """
    out_dir = Path(out_dir)
    label = label or out_dir
    config = read_json_object(out_dir / CONFIG_NAME, shown=Path(label) / CONFIG_NAME, error=ExportError)
    qc = config.get("quantization_config") or {}
    hq = read_json_object(out_dir / HF_QUANT_CONFIG, shown=Path(label) / HF_QUANT_CONFIG, error=ExportError).get("quantization")
    if not isinstance(qc, dict) or not isinstance(hq, dict):
        raise ExportError(f"{label}: config.json quantization_config or hf_quant_config.json quantization "
                          "is not an object")
    excludes = qc.get("ignore", [])
    if excludes != hq.get("exclude_modules"):
        raise ExportError(f"{label}: config.json ignore and hf_quant_config.json exclude_modules differ")
    kv_cache = declares_kv_cache(config)
    for key, want in (("quant_algo", "NVFP4"), ("group_size", BLOCK_SIZE),
                      ("kv_cache_quant_algo", KV_CACHE_QUANT_ALGO if kv_cache else None)):
        if hq.get(key) != want:
            raise ExportError(f"{label}: hf_quant_config.json {key} is {hq.get(key)!r}, expected {want!r}"
                              + (" (config.json's kv_cache_scheme says so)" if key == "kv_cache_quant_algo" else ""))
    if qc.get("kv_cache_scheme") not in (None, KV_CACHE_SCHEME):
        raise ExportError(f"{label}: config.json kv_cache_scheme is {qc.get('kv_cache_scheme')!r}, expected "
                          f"{KV_CACHE_SCHEME!r} (FP8) or none")
    w4a4 = declares_input_activations(config)
    ckpt = Checkpoint(out_dir)  # the same header/index validation as any source
    layout = layout or output_layout(ckpt)
    if layout.act_quant != w4a4:
        raise ExportError(f"{label}: config.json declares {_w4(w4a4)}, the tensors were written {_w4(layout.act_quant)}")
    if layout.kv_cache != kv_cache:
        raise ExportError(f"{label}: config.json declares {'an FP8' if kv_cache else 'no'} KV cache, the tensors "
                          f"were written {'with' if layout.kv_cache else 'without'} k_scale/v_scale")
    header = ckpt.tensors

    def where(name: str) -> Path:
        return Path(label) / header[name].file

    for name in header:
        if name not in layout.by_name:
            raise ExportError(f"{where(name)}: tensor {name}: not in the NVFP4 output table (vLLM does not load "
                              "fused 3-D experts, .moe. or compressed-tensors names for modelopt NVFP4)")
    for lin in layout.linears:
        have = [r for r in QUANT_ROLES if lin.name(r) in header]
        if len(have) != len(lin.roles):
            missing = [r.value for r in lin.roles if r not in have]
            raise ExportError(f"{where(lin.name(have[0])) if have else label}: module {lin.module}: has "
                              f"{[r.value for r in have]}, expected {[r.value for r in lin.roles]} (missing {missing}; "
                              f"{_w4(w4a4)} per config.json)")
    for t in layout.tensors:
        info = header.get(t.name)
        if info is None:
            raise ExportError(f"{label}: tensor {t.name}: missing")
        if (info.dtype, info.shape) != (t.dtype, t.shape):
            raise ExportError(f"{where(t.name)}: tensor {t.name}: {info.dtype} {list(info.shape)}, "
                              f"expected {t.dtype} {list(t.shape)}")
    if values:
        _check_values(ckpt, layout)
    for lin in layout.linears:
        if _excluded(lin.module, excludes):
            raise ExportError(f"module {lin.module}: is quantized but matches the exclusion list")
    kept = [t for t in layout.tensors if t.role == Role.KEPT]
    for t in kept:
        if t.excludable and not _excluded(t.module, excludes):
            raise ExportError(f"tensor {t.name}: kept {t.dtype} but its module is not in the exclusion list")
    tied = is_tied(config)
    for p in excludes:
        if p == "lm_head" and tied:
            continue
        if not any(_excluded(t.module, [p]) for t in kept):
            raise ExportError(f"{label}: exclusion pattern {p!r} matches no tensor in the checkpoint")
    return {"quantized_modules": len(layout.linears), "kept_tensors": len(kept)}


# Quantized linears whose scales _check_values reads at once (about 64 MB of a 26B-A4B's block scales).
_CHECK_BATCH = 256


def _check_values(ckpt: Checkpoint, layout: Nvfp4Layout) -> None:
    """Every scale of every quantized linear finite and > 0 (P04), fused partners sharing theirs.
    Read with :meth:`Checkpoint.read` (exactly the scales' bytes: the result's pages are not in
    the page cache, and an mmap fault would read the codes around each scale from the disk too)."""
    scalars: dict[str, torch.Tensor] = {}
    linears = layout.linears
    for i in range(0, len(linears), _CHECK_BATCH):  # each shard opened once a batch, read in file order
        batch = linears[i : i + _CHECK_BATCH]
        values = ckpt.read_many([lin.name(r) for lin in batch for r in lin.roles[1:]])
        for lin in batch:
            for role in lin.roles[2:]:  # weight_scale_2, input_scale
                v = values[lin.name(role)]
                if not (torch.isfinite(v) and v > 0):
                    raise ExportError(f"tensor {lin.name(role)}: {v.item()} is not finite and > 0")
                scalars[lin.name(role)] = v
            # finite and > 0 on the E4M3 codes, one pass (converting to fp32 first took 4.1 of
            # the 5.3 s this check took on a 10-layer synthetic 26B-A4B's 470M block scales)
            lo, hi = torch.aminmax(values[lin.name(Role.WEIGHT_SCALE)].view(torch.uint8))
            if not (lo >= E4M3_MIN_POSITIVE_CODE and hi <= E4M3_MAX_CODE):
                raise ExportError(f"tensor {lin.name(Role.WEIGHT_SCALE)}: has non-finite or non-positive block scales")
        del values
    for lay in layout.layers:  # FP8 KV cache scales: vLLM divides by them
        for t in lay.kv_scales:
            v = ckpt.read(t.name)
            if not (torch.isfinite(v) and v > 0):
                raise ExportError(f"tensor {t.name}: {v.item()} is not finite and > 0")
    _check_shared(layout, scalars)


def _check_shared(layout: Nvfp4Layout, scalars: dict[str, torch.Tensor]) -> None:
    """Fused partners must carry identical global (and input) scales: an expert's gate and up,
    and every multi-member dense group of the table (q/k/v, gate/up)."""
    by_module = {lin.module: lin for lin in layout.linears}
    for lin in layout.linears:
        if len(lin.group) < 2 or lin.module != lin.group[0]:
            continue
        for role in lin.roles[2:]:
            vals = [scalars[by_module[m].name(role)] for m in lin.group]
            if any(not torch.equal(vals[0], v) for v in vals[1:]):
                raise ExportError(f"modules {', '.join(lin.group)}: {role.value} differs inside a fused group "
                                  "(vLLM keeps one)")
