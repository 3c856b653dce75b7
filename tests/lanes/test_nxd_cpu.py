"""Conformance lane against the real neuronx-distributed (NxD) v2.28.0, the last release for inf2,
run on the CPU in NxD's own CPU mode (marker ``nxd_cpu``; on by default).

Sources: aws-neuron/neuronx-distributed at tag ``v2.28.0`` (``src/neuronx_distributed``) and
aws-neuron/neuronx-distributed-inference at its "Neuron SDK Release 2.28.0" commit (0.8.0,
``src/neuronx_distributed_inference``). Their PyPI packages are empty placeholders, so the lane
needs the source trees: ``G4_NXD_SRC`` / ``G4_NXDI_SRC`` name the ``src`` folders (default: the
team's unmodified snapshots beside the repository, ``../shared/vendor/...``); without them every
test here is skipped with that reason. NxD runs in subprocesses (``tests/lanes/nxd_cpu/worker.py``) with
the Neuron-only imports stubbed (``tests/lanes/nxd_cpu/stubs.py``), in g4's own venv (torch 2.13 CPU,
transformers 5.x: NxD's layers, its sharder and NxDI's GQA helpers import without NxDI's
``transformers==4.57`` pin; only NxDI's engine would need it). Nothing is patched in g4 or NxD.

(a) NxD's sharder vs g4's rank files, TP 1, 2, 4, int8 and bf16 attention. The unsharded input
is g4's TP-1 result (full int8 ``weight`` + fp32 ``scale`` in NxD's layout); KV heads are
replicated to T as NxDI's GQA preshard hook does (``modules/attention/gqa.py``:
``GQA.REPLICATE_TO_TP_DEGREE``, ``replicate_kv`` on weight and scale); the module tree is the
layout table's (``g4/exporters/neuron_int8.py``) with each entry built as the NxD layer its rule
names (``tests/lanes/nxd_cpu/nxd_tree.py``), on the meta device inside NxD's mocked process group, and each rank is cut by
``trace/trace.py: get_sharded_checkpoint``, as ``trace/model_builder.py: ModelBuilder.shard_checkpoint``
does. Every tensor must equal g4's ``weights/tp{r}_sharded_checkpoint.safetensors`` bit for bit.
The embedded model has 2 KV heads on sliding and 1 on full-attention layers, so TP 2 and TP 4
both replicate KV heads.

(b) Each NxD layer type the layout names (``QuantizedColumnParallel`` with and without
``gather_output``, ``QuantizedRowParallel``, ``QuantizedExpertFusedColumnParallel`` (stride 2),
``QuantizedExpertFusedRowParallel``), built as ``tests/lanes/nxd_cpu/nxd_tree.py`` does on the meta device
(NxD's ``parallel_layers/layers.py: _initialize_parameter_cpu`` multiplies then overwrites the
last dim of a quantized parameter, which breaks a CPU-device build of the row and expert-column
layers at TP>1) and loaded from g4's rank files, at TP 1 and 2 (gloo, one process per rank),
against a plain-torch fp32 reference ``x @ (q.float() * scale)`` from the unsharded tensors.
Tolerance on the max abs difference: ``1e-5 * max|ref|`` with fp32 activations, ``2e-2 * max|ref|``
with bf16 activations (the reference sees the same bf16-rounded input; 2e-2 is about 2.5 bf16
ulps; a layout error is O(1)).

What NxD's expert layers take (still asserted, ``test_nxd_expert_layers_refuse_a_3d_input``): 4-D
``[e, 1, c, in]`` (e = E or 1), as NxD's ``modules/moe/experts.py: Experts.forward`` passes them
(``hidden_states.view(e, 1, c, h)``, ``squeeze(1)`` after); a 3-D ``[E, N, in]`` input fails in
``quantization/dequantize.py: scale_dequantize`` (``scale.unsqueeze(ndim - 1)``): ``RuntimeError: output
with shape [E, N, out] doesn't match the broadcast shape [E, E, N, out]``. (g4's former module tree
called them that way; its serving path now runs NxD's ``ExpertMLPsV2`` inside g4's NxDI class.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import free_ports, wait_workers
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
VENDOR = REPO.parent / "shared" / "vendor"
NXD_SRC = Path(os.environ.get("G4_NXD_SRC", VENDOR / "neuronx-distributed-v2.28.0" / "src"))
NXDI_SRC = Path(os.environ.get("G4_NXDI_SRC", VENDOR / "neuronx-distributed-inference-v0.8.0" / "src"))
WORKER = Path(__file__).resolve().parent / "nxd_cpu" / "worker.py"
TOL_FP32, TOL_BF16 = 1e-5, 2e-2
WORKER_TIMEOUT_S = 240


def _missing() -> str | None:
    if not (NXD_SRC / "neuronx_distributed" / "quantization" / "quantization_layers.py").is_file():
        return (f"neuronx-distributed v2.28.0 source not found at {NXD_SRC} (set G4_NXD_SRC to the src/ folder "
                "of aws-neuron/neuronx-distributed@v2.28.0; the PyPI package is a placeholder)")
    if not (NXDI_SRC / "neuronx_distributed_inference" / "modules" / "attention" / "gqa.py").is_file():
        return (f"neuronx-distributed-inference 0.8.0 source not found at {NXDI_SRC} (set G4_NXDI_SRC to the src/ "
                "folder of aws-neuron/neuronx-distributed-inference at its Neuron SDK 2.28.0 release)")
    return None


pytestmark = [pytest.mark.nxd_cpu, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]



def _convert(src: Path, out: Path, tp: int, quantize_attention: bool, **algorithm) -> Path:
    from nxd_cpu.g4names import convert_int8_neuron

    return convert_int8_neuron(src, out, tp=tp, quantize_attention=quantize_attention, target="inf2.24xlarge",
                               progress=False, **algorithm).out


# ``--algorithm gptq`` (other codes, NxD's scales, the same layout): NxD's sharder must cut its TP-1
# result into its TP-2 rank files bit for bit too; 4 x 64 calibration tokens keep it quick.
GPTQ = dict(algorithm="gptq", calib_samples=4, calib_seq_len=64)


def _fused_dim_split(good: Path, bad: Path) -> None:
    """A copy of a TP-2 result whose expert gate_up is cut along the fused 2I dimension (rank r
    gets fused columns [r*I, (r+1)*I): all gate on rank 0, all up on rank 1) instead of NxD's
    stride-2 ``[gate_r | up_r]``: the P11 mistake the sharder check must catch."""
    shutil.copytree(good, bad)
    files = [bad / "weights" / f"tp{r}_sharded_checkpoint.safetensors" for r in (0, 1)]
    sds = [load_file(f) for f in files]
    from nxd_cpu.g4names import rank_module

    gate_up = rank_module("layers.0.experts.gate_up_proj")
    for name in (f"{gate_up}.weight", f"{gate_up}.scale"):
        per = [sd[name] for sd in sds]
        gate = torch.cat([p.chunk(2, -1)[0] for p in per], -1)
        up = torch.cat([p.chunk(2, -1)[1] for p in per], -1)
        sds[0][name], sds[1][name] = gate.contiguous(), up.contiguous()
    for f, sd in zip(files, sds):
        save_file(sd, f)


@pytest.fixture(scope="module")
def lane(tmp_path_factory):
    """Convert the embedded model, then run every NxD worker at once (2 cores: the shard worker
    and the TP-1 and TP-2 layer processes overlap); their JSON results, by job."""
    t0 = time.perf_counter()
    import tiny
    from nxd_cpu.g4names import EMBEDDED_DIR

    base = tmp_path_factory.mktemp("nxd_cpu")
    # transformers-built: 8 query heads, 2 KV heads on the sliding layer and 1 on the full one
    kv_src = tiny.build(base / "tiny-8q2kv", multimodal=False, num_attention_heads=8, num_key_value_heads=2)
    outs = {(tp, qa): _convert(EMBEDDED_DIR, base / f"tp{tp}-{'int8' if qa else 'bf16'}-attn", tp, qa)
            for tp in (1, 2, 4) for qa in (True, False)}
    kv_outs = {tp: _convert(kv_src, base / f"tiny-8q2kv-tp{tp}", tp, True) for tp in (1, 2, 4)}
    gptq_outs = {tp: _convert(EMBEDDED_DIR, base / f"gptq-tp{tp}", tp, True, **GPTQ) for tp in (1, 2)}
    _fused_dim_split(outs[2, True], base / "tp2-fused-dim-split")
    common = {"nxd_src": str(NXD_SRC), "nxdi_src": str(NXDI_SRC)}
    cases = [{"name": f"tp{tp}/{'int8' if qa else 'bf16'}-attn", "tp": tp, "quantize_attention": qa,
              "full": str(outs[1, qa]), "out": str(outs[tp, qa])} for (tp, qa) in outs]
    cases += [{"name": f"tp{tp}/8q2kv", "tp": tp, "quantize_attention": True, "full": str(kv_outs[1]),
               "out": str(kv_outs[tp])} for tp in kv_outs]
    cases.append({"name": "tp2/gptq", "tp": 2, "quantize_attention": True, "full": str(gptq_outs[1]),
                  "out": str(gptq_outs[2])})
    cases.append({"name": "tp2/fused-dim-split", "tp": 2, "quantize_attention": True, "full": str(outs[1, True]),
                  "out": str(base / "tp2-fused-dim-split")})
    source_cases = [{"name": f"source/{'int8' if qa else 'bf16'}-attn", "src": str(EMBEDDED_DIR),
                     "out": str(outs[1, qa]), "quantize_attention": qa} for qa in (True, False)]
    source_cases.append({"name": "source/8q2kv", "src": str(kv_src), "out": str(kv_outs[1]),
                         "quantize_attention": True})
    jobs = {"shard": dict(common, cases=cases, source_cases=source_cases)}
    for tp in (1, 2):
        jobs[f"layers{tp}"] = dict(common, full=str(outs[1, True]), out=str(outs[tp, True]), tol_fp32=TOL_FP32,
                                   tol_bf16=TOL_BF16)
    procs = []
    for (key, job), port in zip(jobs.items(), free_ports(len(jobs))):
        job["result"] = str(base / f"{key}.json")
        (base / f"{key}.job.json").write_text(json.dumps(job))
        mode = "shard" if key == "shard" else "layers"
        world = 1 if key in ("shard", "layers1") else 2
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                       LANE_HANG_S=str(WORKER_TIMEOUT_S - 40))
            log = open(base / f"{key}.rank{rank}.log", "w")
            procs.append((key, rank, log, subprocess.Popen(
                [sys.executable, str(WORKER), mode, str(base / f"{key}.job.json")],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)))
    failures = wait_workers([(f"{key} rank {rank}", base / f"{key}.rank{rank}.log", p)
                             for key, rank, _, p in procs], WORKER_TIMEOUT_S)
    for _, _, log, _ in procs:
        log.close()
    assert not failures, "\n\n".join(failures)
    found = {"shard": json.loads(Path(jobs["shard"]["result"]).read_text())}
    for tp in (1, 2):
        found[f"layers{tp}"] = [json.loads(Path(f"{jobs[f'layers{tp}']['result']}.rank{r}").read_text())
                                for r in range(tp)]
    found["wall_s"] = time.perf_counter() - t0
    print(f"nxd_cpu lane: conversions + workers {found['wall_s']:.1f} s")
    return found


# -------------------------------------------------- (a) the unsharded int8 state dict, NxD's quantizer
SOURCES = ["source/int8-attn", "source/bf16-attn", "source/8q2kv"]
@pytest.mark.parametrize("case", SOURCES)
def test_g4_unsharded_int8_equals_nxd_quantizer_on_the_source_bit_for_bit(lane, case):
    """g4 rounds ``w * fp32(1 / scale)`` as torch.quantize_per_channel does (quantizers/int8.py);
    rounding ``w / scale`` instead gave 649 of 1,531,904 int8 values off by 1 on the embedded model
    (e.g. layers.0.mlp.gate_proj.weight[15, 68]: w / scale = -63.5 exactly, NxD -63, g4 -64)."""
    r = lane["shard"]["results"][case]
    assert r["tensors"] > 50 and len(r["int8"]) >= 15  # the comparison covered the whole model
    assert not r["diffs"], f"{r['tie_diffs']} of {r['tie_elements']} int8 values differ: {r['diffs'][:3]}"


# ------------------------------------------------------------------------------ (a) NxD's sharder
SHARD_CASES = [f"tp{tp}/{a}-attn" for tp in (1, 2, 4) for a in ("int8", "bf16")] + [
    f"tp{tp}/8q2kv" for tp in (1, 2, 4)] + ["tp2/gptq"]


def test_the_tree_is_made_of_nxd_layers(lane):
    int8 = lane["shard"]["results"]["tp2/int8-attn"]["nxd_layers"]
    bf16 = lane["shard"]["results"]["tp2/bf16-attn"]["nxd_layers"]
    assert {"QuantizedColumnParallel", "QuantizedRowParallel", "QuantizedExpertFusedColumnParallel",
            "QuantizedExpertFusedRowParallel"} <= set(int8), int8
    assert {"ColumnParallelLinear", "RowParallelLinear"} <= set(bf16), bf16


@pytest.mark.parametrize("case", SHARD_CASES)
def test_nxd_sharder_gives_g4_rank_files_bit_for_bit(lane, case):
    r = lane["shard"]["results"][case]
    assert not r["dtype_diffs"], r["dtype_diffs"]
    assert len(r["ranks"]) == r["tp"]
    for rank in r["ranks"]:
        assert rank["error"] is None, (case, rank["rank"], rank["error"])
        assert not rank["diffs"], (case, rank["rank"], rank["diffs"][:5])
        assert rank["tensors"] > 50


@pytest.mark.parametrize("tp,expected", [
    (1, []),
    (2, ["layers.3.self_attn.k_proj.weight 1->2"]),
    (4, [f"layers.{L}.self_attn.{p}.weight 2->4" for L in (0, 1, 2) for p in ("k_proj", "v_proj")]
     + ["layers.3.self_attn.k_proj.weight 1->4"]),
])
@pytest.mark.parametrize("attn", ["int8", "bf16"])
def test_kv_heads_fewer_than_ranks_are_replicated_like_nxdi(lane, tp, expected, attn):
    """The bit-for-bit cases above include these layers (embedded: 4 query heads; full-attention
    layer 3 has one KV head and no v_proj: k_eq_v)."""
    got = [s.split(" heads")[0] for s in lane["shard"]["results"][f"tp{tp}/{attn}-attn"]["replicated"]]
    assert got == expected


@pytest.mark.parametrize("tp,expected", [
    (2, ["layers.1.self_attn.k_proj.weight 1->2"]),
    (4, ["layers.0.self_attn.k_proj.weight 2->4", "layers.0.self_attn.v_proj.weight 2->4",
         "layers.1.self_attn.k_proj.weight 1->4"]),
])
def test_kv_heads_replicated_with_four_query_heads_per_kv_head(lane, tp, expected):
    """tiny 8q/2kv: at TP 4 each rank's 2 query heads share one KV head (ranks 0,1 -> head 0;
    2,3 -> head 1); at TP 2 the sliding layer splits its 2 KV heads without replicating."""
    got = [s.split(" heads")[0] for s in lane["shard"]["results"][f"tp{tp}/8q2kv"]["replicated"]]
    assert got == expected


def test_sharder_check_catches_a_gate_up_cut_along_the_fused_dim(lane):
    ranks = lane["shard"]["results"]["tp2/fused-dim-split"]["ranks"]
    for rank in ranks:
        named = sorted(d.split(":")[0] for d in rank["diffs"])
        assert named == ["layers.0.moe.expert_mlps.mlp_op.gate_up_proj.scale",
                         "layers.0.moe.expert_mlps.mlp_op.gate_up_proj.weight"], rank


# -------------------------------------------------------------------- (b) NxD's quantized layers
LAYER_CASES = ["column", "column_gather", "row_mlp_down", "row_o_proj", "expert_gate_up_4d",
               "expert_gate_up_bcast", "expert_down_4d"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", LAYER_CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_nxd_quantized_layer_with_g4_tensors_matches_dequantized_reference(lane, tp, case, dtype):
    for rank, found in enumerate(lane[f"layers{tp}"]):
        r = found["results"][f"{case}/{dtype}"]
        assert "error" not in r, (tp, rank, r)
        assert r["ok"], f"TP {tp} rank {rank} {case} {dtype}: max abs {r['max_abs']:.3g} > {r['tol']:.3g}"


@pytest.mark.parametrize("tp", [1, 2])
def test_nxd_expert_layers_refuse_a_3d_input(lane, tp):
    """What NxD accepts: ``[e, 1, c, in]`` (the 4d and bcast cases above pass); ``[E, N, in]`` raises."""
    for found in lane[f"layers{tp}"]:
        for case in ("expert_gate_up_3d", "expert_down_3d"):
            for dtype in ("fp32", "bf16"):
                r = found["results"][f"{case}/{dtype}"]
                assert "doesn't match the broadcast shape" in r.get("error", ""), r
                assert "dequantize.py" in r["where"], r


def test_lane_fits_its_budget(lane):
    """The whole lane (conversions, NxD imports, every worker) within 3 minutes on 2 cores."""
    assert lane["wall_s"] < 180, lane["wall_s"]
