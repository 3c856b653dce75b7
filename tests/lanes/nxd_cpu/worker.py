"""Subprocess side of the NxD CPU lane (``tests/lanes/test_nxd_cpu.py``): runs neuronx-distributed
(NxD) v2.28.0's real sharder and quantized layers on g4's int8-neuron output and writes what it
found as JSON. Never imported by the pytest process (it installs import stubs, ``stubs.py``).

``python worker.py shard JOB.json``: first NxD's own per-channel quantizer on the Hugging Face
source against g4's TP-1 file (``source``), then NxD's sharder. For each TP degree T it builds the
layout table's tree of NxD layers (``nxd_tree.layout_tree``) on the meta device inside
NxD's mocked process group, exactly as ``ModelBuilder.shard_checkpoint`` does
(aws-neuron/neuronx-distributed ``src/neuronx_distributed/trace/model_builder.py``:
``mock_distributed`` + ``init_process_group("xla")`` + ``initialize_model_parallel(...,
skip_collective_init=True)``, model built once, then ``get_sharded_checkpoint(copy, model, rank,
T, is_cached=True)`` per rank, ``trace/trace.py``). The unsharded input is g4's TP-1 result (the
full int8 tensors in NxD's layout), with KV heads replicated the way NxD Inference's GQA
preshard hook does for ``GQA.REPLICATE_TO_TP_DEGREE`` (aws-neuron/neuronx-distributed-inference
``src/neuronx_distributed_inference/modules/attention/gqa.py``: ``determine_sharding_strategy``,
``get_shardable_head_counts``, ``replicate_kv``, weight and per-channel scale together).
Each rank's result is compared with g4's ``weights/tp{r}_sharded_checkpoint.safetensors``.

``python worker.py layers JOB.json`` (one process per rank; RANK, WORLD_SIZE, MASTER_PORT in the
environment): NxD's CPU mode (``NXD_CPU_MODE=1``, gloo, ``initialize_model_parallel(T)``); each
quantized layer type the layout table names is built (``nxd_tree.NxdLayers``) on the meta device, loaded
with g4's rank tensors (``load_state_dict(strict=True, assign=True)``) and run against a plain
torch fp32 reference: dequantized weight ``q.float() * scale`` from the unsharded tensors.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nxd_cpu import stubs  # noqa: E402

T0 = time.perf_counter()


def _install(job: dict) -> None:
    stubs.install(job["nxd_src"])
    if job.get("nxdi_src"):
        sys.path.insert(0, job["nxdi_src"])


def _describe(name: str, got, want) -> str | None:
    """None when ``got`` equals ``want`` bit for bit, else what differs."""
    import torch

    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{name}: NxD gives {got.dtype} {list(got.shape)}, g4 wrote {want.dtype} {list(want.shape)}"
    if torch.equal(got.view(torch.uint8) if got.dtype == torch.int8 else got,
                   want.view(torch.uint8) if want.dtype == torch.int8 else want):
        return None
    bad = (got != want).nonzero()
    return (f"{name}: {len(bad)} of {got.numel()} elements differ, first at index {bad[0].tolist()} "
            f"(NxD {got[tuple(bad[0])].item()}, g4 {want[tuple(bad[0])].item()})")


# ---------------------------------------------------------------------------------------------- shard
def shard(job: dict) -> dict:
    _install(job)
    import torch
    from safetensors.torch import load_file

    import neuronx_distributed_inference.modules.lora_serving  # noqa: F401  (NxDI's own import order: breaks a cycle)
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trace.mock_torchdist import mock_distributed
    from neuronx_distributed.trace.trace import get_sharded_checkpoint, preprocess_checkpoint
    from neuronx_distributed.utils.model_utils import init_on_device
    from neuronx_distributed_inference.modules.attention.gqa import (
        determine_sharding_strategy, get_shardable_head_counts, replicate_kv)
    from nxd_cpu.g4names import geometry, rank_indices
    from nxd_cpu.nxd_tree import NxdLayers, layout_tree

    results = {}
    for case in job["cases"]:  # {"name", "full": TP-1 dir, "out": TP-T dir, "tp", "quantize_attention"}
        T, full_dir, out_dir = case["tp"], Path(case["full"]), Path(case["out"])
        config = json.loads((out_dir / "config.json").read_text())
        full = load_file(full_dir / "weights" / "tp0_sharded_checkpoint.safetensors")
        g = geometry(config, T)
        for name in rank_indices(full):  # NxD's SPMDRank checkpoint value, as NxDI's converters write it
            full[name] = torch.arange(0, T, dtype=torch.int32)
        replicated = []
        for L in range(g.num_layers):  # NxDI GQA preshard: replicate K/V heads (and their scales) to T
            kv = g.kv_heads[L]
            strategy = determine_sharding_strategy(T, kv)
            _, kv_new = get_shardable_head_counts(T, g.heads, kv, strategy)
            if kv_new == kv:
                continue
            for p in ("k_proj", "v_proj"):
                w = f"layers.{L}.self_attn.{p}.weight"
                if w not in full:
                    continue  # k_eq_v full-attention layer: no v_proj
                s = f"layers.{L}.self_attn.{p}.scale"
                full[w], scale = replicate_kv(full[w], source_heads=kv, repeats=kv_new // kv, head_dim=0,
                                              tensor_scale=full.get(s))
                if scale is not None:
                    full[s] = scale
                replicated.append(f"{w} {kv}->{kv_new} heads ({strategy.name})")
        ranks = []
        # ModelBuilder shards outside NxD's CPU mode (its mocked "xla" group has no gloo groups)
        os.environ["NXD_CPU_MODE"] = "0"
        with mock_distributed(world_size=T), init_on_device(torch.device("meta"), force_custom_init_on_device=True):
            torch.distributed.init_process_group(backend="xla", rank=0, world_size=T)
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=T, skip_collective_init=True)
            try:
                model = layout_tree(full, g.num_layers, g.has_v, quantize_attention=case["quantize_attention"],
                                    tied=g.arch.tied, ops=NxdLayers(T))
                layer_types = sorted({type(m).__name__ for m in model.modules()
                                      if type(m).__module__.startswith("neuronx_distributed")})
                ckpt = dict(full)
                preprocess_checkpoint(model, ckpt)
                dtype_diffs = [f"{k}: unsharded {ckpt[k].dtype}, NxD module {v.dtype}"
                               for k, v in model.state_dict().items() if k in ckpt and ckpt[k].dtype != v.dtype]
                for rank in range(T):
                    sharded = dict(ckpt)
                    error = None
                    try:
                        get_sharded_checkpoint(sharded, model, rank, T, is_cached=True)
                    except Exception as e:  # noqa: BLE001  (reported, the test asserts on it)
                        error = f"{type(e).__name__}: {e}"
                    g4 = load_file(out_dir / "weights" / f"tp{rank}_sharded_checkpoint.safetensors")
                    diffs = []
                    if error is None:
                        missing, extra = sorted(set(g4) - set(sharded)), sorted(set(sharded) - set(g4))
                        if missing or extra:
                            diffs.append(f"keys: only in g4 {missing[:5]}, only from NxD {extra[:5]}")
                        for k in sorted(set(g4) & set(sharded)):
                            d = _describe(k, sharded[k].contiguous(), g4[k])
                            if d:
                                diffs.append(d)
                    ranks.append({"rank": rank, "error": error, "diffs": diffs, "tensors": len(g4)})
            finally:
                parallel_state.destroy_model_parallel()
                torch.distributed.destroy_process_group()
        results[case["name"]] = {"tp": T, "replicated": replicated, "nxd_layers": layer_types,
                                 "dtype_diffs": dtype_diffs, "ranks": ranks}
    return results


# --------------------------------------------------------------------------------------------- source
def source(job: dict) -> dict:
    """g4's TP-1 file (the unsharded int8 state dict the sharder check starts from) against NxD's own
    per-channel quantizer applied to the Hugging Face source tensors, bit for bit.

    Quantizer: ``quantization/quantization_utils.py: quantize_per_channel_symmetric`` (torch's
    ``PerChannelAbsMaxObserver``, qint8, symmetric) and ``extract_q_scale`` (fp32 scale shaped to
    broadcast), one scale per output channel (per expert and output channel for experts). Layout:
    NxD's expert layers hold ``weight [E, in, out]`` and ``scale [E, 1, out]``
    (``quantization/quantization_layers.py``), gate columns before up columns (``Experts`` takes
    ``chunk(2, -1)``, ``modules/moe/experts.py``); Hugging Face stores ``gate_up_proj [E, 2I, H]``
    (gate rows first) and ``down_proj [E, H, I]``. The lm_head is the tied embedding.
    """
    _install(job)
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from neuronx_distributed.quantization.quantization_utils import extract_q_scale, quantize_per_channel_symmetric
    from nxd_cpu.g4names import rank_indices, rank_module, rank_tensor

    ties = {}

    def nxd_int8(w, name):  # [..., out, in] -> int8 [..., out, in], fp32 [..., out, 1]
        q = quantize_per_channel_symmetric(w.float().reshape(-1, w.shape[-1]), channel_axis=0)
        scale = extract_q_scale(q).reshape(*w.shape[:-1], 1)
        # w / scale within 1e-4 of half-way between two integers: where dividing by the scale (g4) and
        # multiplying by its fp32 reciprocal (torch's quantize_per_channel) can round apart
        ties[name] = ((w.float() / scale).abs().frac() - 0.5).abs() < 1e-4
        return q.int_repr().reshape(w.shape), scale

    results = {}
    for case in job["source_cases"]:  # {"name", "src", "out", "quantize_attention"}
        hf = {}
        for f in sorted(Path(case["src"]).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                hf.update({k: st.get_tensor(k) for k in st.keys()})
        text = "model.language_model." if any(k.startswith("model.language_model.") for k in hf) else "model."
        want = {}
        for k, v in hf.items():
            if not k.startswith(text):
                continue
            name = k[len(text):]
            module = name.rsplit(".", 1)[0] if name.endswith(".weight") else name
            if name == "embed_tokens.weight":
                want["lm_head.weight"], want["lm_head.scale"] = nxd_int8(v, "lm_head.weight")
                want[name] = v  # the device embedding; at TP 1 the whole table
            elif module.endswith(("experts.gate_up_proj", "experts.down_proj")):
                module = rank_module(module)
                q, sc = nxd_int8(v, f"{module}.weight")
                want[f"{module}.weight"], want[f"{module}.scale"] = q.transpose(1, 2), sc.transpose(1, 2)
                ties[f"{module}.weight"] = ties[f"{module}.weight"].transpose(1, 2)
            elif module.split(".")[-1] in ("gate_proj", "up_proj", "down_proj") or (
                    case["quantize_attention"] and module.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")):
                module = rank_module(module)
                want[f"{module}.weight"], want[f"{module}.scale"] = nxd_int8(v, f"{module}.weight")
            else:
                want[rank_tensor(name)] = v
        g4 = load_file(Path(case["out"]) / "weights" / "tp0_sharded_checkpoint.safetensors")
        for k in rank_indices(g4):  # NxD's SPMD rank index of rank 0 (no source tensor)
            want[k] = torch.zeros(1, dtype=torch.int32)
        diffs = []
        missing, extra = sorted(set(want) - set(g4)), sorted(set(g4) - set(want))
        if missing or extra:
            diffs.append(f"keys: only from the source {missing[:5]}, only in g4 {extra[:5]}")
        off_tie, tie_count, elements = [], 0, 0
        for k in sorted(set(want) & set(g4)):
            d = _describe(k, want[k].contiguous(), g4[k])
            if not d:
                continue
            diffs.append(d)
            # same layout and scales, int8 values apart by 1 only where w / scale is (nearly) x.5?
            if k in ties and want[k].shape == g4[k].shape and g4[k].dtype == torch.int8:
                delta = (want[k].int() - g4[k].int())
                bad = (delta != 0) & ~ties[k]
                tie_count, elements = tie_count + int((delta != 0).sum()), elements + delta.numel()
                if bad.any() or delta.abs().max() > 1:
                    off_tie.append(d)
            else:
                off_tie.append(d)
        results[case["name"]] = {"diffs": diffs, "off_tie_diffs": off_tie, "tie_diffs": tie_count,
                                 "tie_elements": elements, "tensors": len(g4),
                                 "int8": sorted(k for k, v in g4.items() if v.dtype == torch.int8)}
    return results


# --------------------------------------------------------------------------------------------- layers
def layers(job: dict) -> dict:
    _install(job)
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from neuronx_distributed.parallel_layers import parallel_state
    from nxd_cpu.g4names import geometry, rank_module
    from nxd_cpu.nxd_tree import NxdLayers

    rank, T = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=T)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=T)
    out_dir, full_dir = Path(job["out"]), Path(job["full"])
    config = json.loads((out_dir / "config.json").read_text())
    g = geometry(config, T)
    mine = load_file(out_dir / "weights" / f"tp{rank}_sharded_checkpoint.safetensors")
    full = load_file(full_dir / "weights" / "tp0_sharded_checkpoint.safetensors")
    gen = torch.Generator().manual_seed(1234)
    N, B, S = 6, 2, 3  # tokens
    E, H, I, V, Id = g.experts, g.hidden, g.moe_intermediate, g.vocab, g.intermediate

    def deq(prefix):  # unsharded dequantized weight, fp32 (NxD layout)
        return full[prefix + ".weight"].float() * full[prefix + ".scale"]

    def gather_last(y):
        parts = [torch.empty_like(y) for _ in range(T)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, -1)

    def summed(y):
        y = y.contiguous().clone()
        dist.all_reduce(y)
        return y

    def own(x, dim=-1):  # this rank's input slice of an input-parallel layer
        per = x.shape[dim] // T
        return x.narrow(dim, rank * per, per)

    def build(make, prefix):
        with torch.device("meta"):  # NxD construction bug at TP>1 on the CPU device (see test docstring)
            layer = make()
        sd = {k[len(prefix) + 1:]: v for k, v in mine.items() if k.startswith(prefix + ".")}
        layer.load_state_dict(sd, strict=True, assign=True)
        return layer.eval()

    results = {}

    def record(name, fn, tol_rel):
        try:
            with torch.no_grad():
                got, ref = fn()
            err = (got.float() - ref).abs().max().item()
            scale = ref.abs().max().item()
            results[name] = {"ok": bool(err <= tol_rel * scale), "max_abs": err, "ref_max": scale,
                             "tol": tol_rel * scale, "shape": list(got.shape)}
        except Exception as e:  # noqa: BLE001  (reported, the test asserts on it)
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                             "where": traceback.format_exc().strip().splitlines()[-3].strip()}

    for dtype, tol in ((torch.float32, job["tol_fp32"]), (torch.bfloat16, job["tol_bf16"])):
        ops = NxdLayers(T, dtype=dtype)
        dn = "fp32" if dtype == torch.float32 else "bf16"

        def rnd(*shape):  # input in the layer dtype; the reference sees the same rounded values in fp32
            return torch.randn(*shape, generator=gen).to(dtype)

        def column():
            x = rnd(B, S, H)
            y = build(lambda: ops.column(H, Id, int8=True), "layers.0.mlp.gate_proj")(x)
            return gather_last(y.float()), x.float() @ deq("layers.0.mlp.gate_proj").T

        def column_gather():
            x = rnd(B, S, H)
            y = build(lambda: ops.column(H, V, int8=True, gather_output=True), "lm_head")(x)
            return y, x.float() @ deq("lm_head").T

        def row(prefix, n_in):
            def run():
                x = rnd(B, S, n_in)
                y = build(lambda: ops.row(n_in, H, int8=True), prefix)(own(x))
                return y, x.float() @ deq(prefix).T
            return run

        def expert_gate_up(shape):
            def run():
                x = rnd(E, N, H)
                if shape == "bcast":  # one token set for every expert: NxD's Experts gets [1, C, H]
                    x = x[:1].expand(E, N, H)
                layer = build(lambda: ops.expert_gate_up(E, H, I), rank_module("layers.0.experts.gate_up_proj"))
                arg = {"3d": x, "4d": x.unsqueeze(1), "bcast": x[:1].unsqueeze(1)}[shape]
                y = layer(arg)
                y = y if shape == "3d" else y.squeeze(1)
                gate, up = y.float().chunk(2, -1)  # rank r holds [gate_r | up_r] (stride 2)
                ref = torch.einsum("enh,ehi->eni", x.float(), deq(rank_module("layers.0.experts.gate_up_proj")))
                return torch.cat([gather_last(gate), gather_last(up)], -1), ref
            return run

        def expert_down(shape4):
            def run():
                x = rnd(E, N, I)
                layer = build(lambda: ops.expert_down(E, I, H), rank_module("layers.0.experts.down_proj"))
                xr = own(x)
                y = layer(xr.unsqueeze(1) if shape4 else xr)
                y = y.squeeze(1) if shape4 else y
                # reduce_output=False: the partial sums are all-reduced after the MoE combine
                return summed(y.float()), torch.einsum("eni,eih->enh", x.float(),
                                                       deq(rank_module("layers.0.experts.down_proj")))
            return run

        record(f"column/{dn}", column, tol)
        record(f"column_gather/{dn}", column_gather, tol)
        record(f"row_mlp_down/{dn}", row("layers.0.mlp.down_proj", Id), tol)
        record(f"row_o_proj/{dn}", row("layers.0.self_attn.o_proj", g.heads * g.head_dim[0]), tol)
        record(f"expert_gate_up_4d/{dn}", expert_gate_up("4d"), tol)
        record(f"expert_gate_up_bcast/{dn}", expert_gate_up("bcast"), tol)
        record(f"expert_down_4d/{dn}", expert_down(True), tol)
        record(f"expert_gate_up_3d/{dn}", expert_gate_up("3d"), tol)
        record(f"expert_down_3d/{dn}", expert_down(False), tol)

    dist.barrier()
    dist.destroy_process_group()
    return results


def main() -> None:
    mode, job_path = sys.argv[1], Path(sys.argv[2])
    job = json.loads(job_path.read_text())
    if mode == "shard":  # one process: NxD's quantizer on the source, then NxD's sharder
        result = {**source(job), **shard(job)}
    else:
        result = layers(job)
    result = {"results": result, "wall_s": round(time.perf_counter() - T0, 2)}
    suffix = f".rank{os.environ['RANK']}" if mode == "layers" else ""
    Path(job["result"] + suffix).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    # a hung rank writes every thread's stack into its log and exits 1 before the lane gives up on it
    faulthandler.dump_traceback_later(float(os.environ.get("LANE_HANG_S", "200")), exit=True)
    main()
