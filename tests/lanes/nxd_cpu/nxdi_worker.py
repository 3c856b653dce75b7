"""Subprocess side of the NxDI Gemma 4 lane (``tests/lanes/test_nxdi_gemma4.py``): g4's
``NeuronGemma4MoEForCausalLM`` (``g4/serve/nxdi_gemma4.py``) run through NxD Inference 0.8's own CPU
engine (``NeuronConfig(on_cpu=True)`` + ``to_cpu()``: aws-neuron/neuronx-distributed-inference
``src/neuronx_distributed_inference/models/application_base.py``), greedy, batch 1.

Runs in g4's venv with transformers 4.57 (NxDI 0.8's pin) put first on ``PYTHONPATH`` by the
test, Neuron-only imports stubbed (``stubs.install_nxdi``). Never imported by the pytest process.

``python nxdi_worker.py JOB.json``; JOB (or a list of JOBs of one TP degree, run one after another): ``nxd_src``, ``nxdi_src``, ``model``, ``prompt`` (ids),
``model_per_rank`` (instead of ``model``: rank r's directory), ``master_port`` (optional: this job's gloo port), ``new_tokens``, ``seq_len``, ``tp`` (one process per rank, RANK / WORLD_SIZE / MASTER_PORT in the
environment, as torchrun sets them; NxDI's ``to_cpu`` then opens the gloo group), ``dtype`` (float32 / bfloat16), ``overrides`` (config attributes, e.g.
``sliding_window``), ``result`` (a .pt file, ``.rank{r}`` appended at TP > 1: tokens, logits ``[steps, vocab]`` fp32 and what ran).
A job with ``"kind": "engine"`` drives g4's serving engine instead (:func:`engine`). A JOB with
``"kind": "specs"`` (``configs``: name -> directory with a ``config.json``, ``tps``: name -> TP degrees)
builds the int8 class on the meta device and reports its ``state_dict()`` specs (:func:`specs`); run
last in a process, it tears down that process's gloo group.
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


def main(job: dict) -> dict:
    stubs.install_nxdi(job["nxd_src"], job["nxdi_src"])
    import torch
    import transformers

    from g4.serve import nxdi_gemma4 as g
    from neuronx_distributed_inference.models.config import MoENeuronConfig

    t_import = time.perf_counter() - T0 if not getattr(main, "ran", False) else 0.0
    main.ran = True
    t0 = time.perf_counter()
    if "master_port" in job:  # a fresh gloo rendezvous per job (a reused port after destroy can hang)
        os.environ["MASTER_PORT"] = str(job["master_port"])
    if "model_per_rank" in job:  # rank r's own view of a pre-sharded result (only weights/tp{r})
        job = dict(job, model=job["model_per_rank"][int(os.environ.get("RANK", "0"))])
    dtype = getattr(torch, job["dtype"])
    neuron_config = MoENeuronConfig(tp_degree=job.get("tp", 1), batch_size=1, seq_len=job["seq_len"], torch_dtype=dtype,
                                    on_cpu=True, **({"quantized": True, "quantized_checkpoints_path": job["model"],
                                                     "quantization_type": "expert_wise_per_channel_symmetric",
                                                     "modules_to_not_convert": ["self_attn", "router", "embed_tokens"]}
                                                    if job.get("quantized") else {}))
    config = g.Gemma4MoEInferenceConfig(neuron_config, load_config=g.load_gemma4_config(job["model"]),
                                        **job.get("overrides", {}))
    model = g.NeuronGemma4MoEForCausalLM(job["model"], config)
    model.to_cpu()
    t_load = time.perf_counter() - t0

    net = model.context_encoding_model.model
    assert net is model.token_generation_model.model  # NxDI's CPU mode: one shared module

    # every parameter and buffer of the module must come from the checkpoint (to_cpu loads with
    # strict=False, which would leave a misnamed weight at its initial value)
    if job.get("quantized"):  # Route 2: this rank's pre-sharded file, as to_cpu loaded it
        sd = g.load_g4_int8_neuron(job["model"], config)
    else:
        sd = model.get_state_dict(job["model"], config)
    own = {k for k in net.state_dict() if not k.startswith("kv_mgr.")}
    missing, unexpected = sorted(own - set(sd)), sorted(set(sd) - own)
    # the module's own state (names, dtypes, per-rank shapes), and whether it holds the file's values
    specs = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in net.state_dict().items()
             if k in own}
    loaded_equal = sorted(k for k in own & set(sd) if torch.equal(net.state_dict()[k], sd[k].to(net.state_dict()[k].dtype)))

    # what the experts ran: ExpertMLPsV2.forward dispatches to forward_all_experts (context
    # encoding of T*top_k < block_size tokens), forward_selective_loading (token generation, only
    # the chosen experts' weights) or forward_blockwise; counted on this instance.
    calls = []
    for layer in net.layers:
        em = layer.moe.expert_mlps
        for name in ("forward_all_experts", "forward_selective_loading", "forward_blockwise",
                     "forward_capacity_factor"):
            orig = getattr(em, name)

            def wrapped(*a, _orig=orig, _name=name, **k):
                calls.append((_name, int(a[0].shape[0])))
                return _orig(*a, **k)
            setattr(em, name, wrapped)
    shapes = []
    net.register_forward_pre_hook(lambda m, args: shapes.append(list(args[0].shape)))
    # the embedding module's output of the first call (context encoding: the prompt, padded to
    # seq_len), in the module's dtype: the lane holds it to transformers' scaled embedding bit for bit
    embeds = []
    net.embed_tokens.register_forward_hook(lambda m, args, out: None if embeds else embeds.append(out.detach().clone()))

    t1 = time.perf_counter()
    tokens, logits = g.greedy_generate(model, job["prompt"], job["new_tokens"])
    t_gen = time.perf_counter() - t1
    kv = [list(p.shape) for p in net.kv_mgr.past_key_values]
    kv_bytes = sum(p.numel() * p.element_size() for p in net.kv_mgr.past_key_values)
    local = {k: list(v.shape) for k, v in net.state_dict().items() if ".self_attn." in k or "expert_mlps" in k}
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()  # a clean exit at TP > 1 needs barrier + destroy
        torch.distributed.destroy_process_group()
    return {"tokens": tokens, "logits": logits, "missing": missing, "unexpected": unexpected, "specs": specs,
            "loaded_equal": loaded_equal, "rank_file_keys": len(sd), "embeds": embeds[0],
            "expert_calls": calls, "input_shapes": shapes, "kv_shapes": kv, "kv_bytes": kv_bytes, "local_shapes": local, "transformers": transformers.__version__,
            "classes": sorted({type(m).__name__ for m in net.modules()}),
            "t_import": t_import, "t_load": t_load, "t_gen": t_gen}


G4_SERVING_MODULES = ("g4.serve.engine", "g4.serve.chat", "g4.serve.server", "g4.serve.cli", "g4.serve.neuron_backend",
                      "g4.serve.nxdi_gemma4", "g4.serve.neuron_emulator", "g4.exporters.neuron_int8")


def engine(job: dict) -> dict:
    """``g4.serve.neuron_backend.NeuronEngine`` on ``job["model"]`` (an int8-neuron result whose
    manifest says ``max_length`` = ``seq_len``) in NxDI's CPU mode: greedy through ``start`` and
    ``step`` for ``new_tokens`` tokens (fed ``job["forced"][i]`` at step i instead of the argmax where
    given: teacher forcing), then ``greedy_generate`` on the same model object (not when forced); a prompt
    one token longer than the engine's ``max_prompt`` (``start`` must refuse it); then the HTTP app
    (``create_app``) over the engine: one chat request, one whose ``max_tokens`` does not fit and a
    completion whose prompt is longer than ``max_prompt``."""
    stubs.install_nxdi(job["nxd_src"], job["nxdi_src"])
    import importlib

    import torch
    import transformers

    imports = {}
    for name in G4_SERVING_MODULES:  # the modules g4's neuron serving path needs, under transformers 4.57
        try:
            importlib.import_module(name)
            imports[name] = "ok"
        except Exception as e:  # noqa: BLE001  (reported)
            imports[name] = f"{type(e).__name__}: {e}"
    from g4.serve import nxdi_gemma4 as g
    from g4.serve.neuron_backend import NeuronEngine, load_neuron_engine

    t_import = time.perf_counter() - T0 if not getattr(main, "ran", False) else 0.0
    main.ran = True
    t0 = time.perf_counter()
    eng = load_neuron_engine(job["model"], on_cpu=True)
    t_load = time.perf_counter() - t0
    assert isinstance(eng, NeuronEngine)
    net = eng.model.context_encoding_model.model
    shapes = []
    hook = net.register_forward_pre_hook(lambda m, args: shapes.append(list(args[0].shape)))
    t1 = time.perf_counter()
    tokens, logits = [], []
    state, step_logits = eng.start(job["prompt"])
    for i in range(job["new_tokens"]):
        tokens.append(int(step_logits.argmax()))
        logits.append(step_logits)
        if i + 1 < job["new_tokens"]:
            state, step_logits = eng.step(state, job["forced"][i] if job.get("forced") else tokens[-1])
    eng.finish(state)  # its KV cache slot free again, for the HTTP requests below
    t_gen = time.perf_counter() - t1
    hook.remove()
    ref_tokens, ref_logits = (None, None) if job.get("forced") else g.greedy_generate(eng.model, job["prompt"],
                                                                                        job["new_tokens"])
    over = list(range(3, 3 + eng.max_prompt + 1))  # one token past the longest prompt
    try:
        eng.start(over)
        start_over = "accepted"
    except Exception as e:  # noqa: BLE001  (reported)
        start_over = f"{type(e).__name__}: {e}"

    from fastapi.testclient import TestClient

    from g4.serve.server import create_app

    app = create_app(eng, served_model_name="tiny-neuron")
    question = {"model": "tiny-neuron", "messages": [{"role": "user", "content": job["question"]}], "temperature": 0,
                "max_tokens": 8, "return_token_ids": True}
    with TestClient(app) as client:
        chat = client.post("/v1/chat/completions", json=question)
        too_long = client.post("/v1/chat/completions", json=dict(question, max_tokens=eng.max_length))
        over_prompt = client.post("/v1/completions", json={"model": "tiny-neuron", "prompt": over, "max_tokens": 1})
        models = client.get("/v1/models").json()
    app.state.worker.close()
    return {"tokens": tokens, "logits": torch.stack(logits), "greedy_tokens": ref_tokens, "greedy_logits": ref_logits,
            "input_shapes": shapes, "state": state, "max_context": eng.max_context, "max_prompt": eng.max_prompt,
            "description": eng.description, "start_over": start_over,
            "kv_shapes": [list(t.shape) for t in net.kv_mgr.past_key_values],
            "over_prompt": {"status": over_prompt.status_code, "body": over_prompt.json()},
            "chat": {"status": chat.status_code, "body": chat.json()},
            "too_long": {"status": too_long.status_code, "body": too_long.json()}, "models": models,
            "imports": imports, "transformers": transformers.__version__,
            "classes": sorted({type(m).__name__ for m in net.modules()}),
            "t_import": t_import, "t_load": t_load, "t_gen": t_gen}


def batch(job: dict) -> dict:
    """g4serve's ``NeuronEngine`` with NxDI's continuous batching (``max_batch_size`` B) on
    ``job["model"]`` in NxDI's CPU mode, against the same result at batch 1.

    For each B in ``job["batch_sizes"]``: every ``[prompt, new_tokens]`` of ``job["prompts"]`` is
    greedy-decoded in a thread of its own, all threads started together (so sequences join and
    leave while others decode, and a slot freed by a short request is taken by a waiting one), each
    through ``start``, ``step`` and ``finish`` (as ``Engine.generate_steps`` drives them). Returns
    per B the ids and logits of each prompt, the rows of every token-generation call, and the
    context-encoding and token-generation input shapes; then the batch-1 engine's ids and logits
    for each prompt one after another. Then the HTTP app over the B = 2 engine with two chat
    requests at once."""
    stubs.install_nxdi(job["nxd_src"], job["nxdi_src"])
    import threading

    import torch

    from g4.serve.neuron_backend import load_neuron_engine

    def run(eng, prompt, n):
        tokens, logits = [], []
        state, step_logits = eng.start(prompt)
        try:
            for i in range(n):
                tokens.append(int(step_logits.argmax()))
                logits.append(step_logits)
                if i + 1 < n:
                    state, step_logits = eng.step(state, tokens[-1])
        finally:
            eng.finish(state)
        return tokens, torch.stack(logits)

    t0 = time.perf_counter()
    found = {}
    for size in job["batch_sizes"]:
        eng = load_neuron_engine(job["model"], on_cpu=True, max_batch_size=size)
        shapes = {"cte": [], "tkg": []}
        for tag, wrapper in (("cte", eng.model.context_encoding_model), ("tkg", eng.model.token_generation_model)):
            wrapper.model.register_forward_pre_hook(lambda m, args, tag=tag: shapes[tag].append(list(args[0].shape)))
        results, errors = {}, []
        gate = threading.Barrier(len(job["prompts"]))

        def one(i, prompt, n, eng=eng, results=results, gate=gate):
            try:
                gate.wait()
                results[i] = run(eng, prompt, n)
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=one, args=(i, p, n)) for i, (p, n) in enumerate(job["prompts"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        found[size] = {"tokens": [results[i][0] for i in range(len(job["prompts"]))],
                       "logits": [results[i][1] for i in range(len(job["prompts"]))],
                       "decode_batches": list(eng.batcher.decode_batches),
                       "shapes": {k: list(v) for k, v in shapes.items()},  # before the HTTP requests below
                       "kv_lines": eng.model.context_encoding_model.model.kv_mgr.past_key_values[0].shape[0],
                       "modules": len({id(w.model) for w in eng.model.models}), "active_after": eng.batcher.active}
        if size == 2:
            from fastapi.testclient import TestClient

            from g4.serve.server import create_app

            app = create_app(eng, served_model_name="tiny-neuron")
            before = len(eng.batcher.decode_batches)

            def post(client, q):
                return client.post("/v1/chat/completions", json={
                    "model": "tiny-neuron", "messages": [{"role": "user", "content": q}], "temperature": 0,
                    "max_tokens": 8, "return_token_ids": True}).json()

            together = [None] * len(job["questions"])
            # each request holds its slot before either decodes: sent at once, a request of a few
            # tokens can otherwise end before the other's context encoding on a loaded machine
            held, start = threading.Barrier(len(job["questions"])), eng.start

            def start_together(prompt_ids):
                state = start(prompt_ids)
                held.wait(120)
                return state

            eng.start = start_together
            with TestClient(app) as client:
                asks = [threading.Thread(target=lambda i=i, q=q: together.__setitem__(i, post(client, q)))
                        for i, q in enumerate(job["questions"])]
                for t in asks:
                    t.start()
                for t in asks:
                    t.join(120)
                batches = eng.batcher.decode_batches[before:]
                del eng.start  # the class's own again
                alone = [post(client, q) for q in job["questions"]]  # one after another: the same answers
            app.state.worker.close()
            found["http"] = {"together": together, "alone": alone, "decode_batches": batches,
                             "threads": len(app.state.worker.threads)}
        del eng
    eng = load_neuron_engine(job["model"], on_cpu=True)
    found[1] = {"tokens": [], "logits": []}
    for prompt, n in job["prompts"]:
        tokens, logits = run(eng, prompt, n)
        found[1]["tokens"].append(tokens)
        found[1]["logits"].append(logits)
    found["t_gen"] = time.perf_counter() - t0
    return found


def specs(job: dict) -> dict:
    """The class's int8 ``state_dict()`` (names, dtypes, per-rank shapes; KV cache aside) at
    ``torch_dtype=bfloat16`` (the Neuron dtype) for each config directory and TP degree, built on the
    meta device inside NxD's mocked process group, as NxD's ModelBuilder builds for sharding
    (aws-neuron/neuronx-distributed ``src/neuronx_distributed/trace/model_builder.py``)."""
    stubs.install_nxdi(job["nxd_src"], job["nxdi_src"])
    import torch

    from g4.serve import nxdi_gemma4 as g
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.trace.mock_torchdist import mock_distributed
    from neuronx_distributed.utils.model_utils import init_on_device
    from neuronx_distributed_inference.models.config import MoENeuronConfig

    if torch.distributed.is_initialized():  # the gloo group of an earlier to_cpu() in this process
        torch.distributed.destroy_process_group()
    os.environ["NXD_CPU_MODE"] = "0"  # the mocked "xla" group has no gloo groups
    found = {}
    for name, model_dir in job["configs"].items():
        for tp in job["tps"][name]:
            with mock_distributed(world_size=tp), init_on_device(torch.device("meta"), force_custom_init_on_device=True):
                torch.distributed.init_process_group(backend="xla", rank=0, world_size=tp)
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, skip_collective_init=True)
                try:
                    nc = MoENeuronConfig(tp_degree=tp, batch_size=1, seq_len=32, torch_dtype=torch.bfloat16,
                                         on_cpu=True, quantized=True, quantized_checkpoints_path=model_dir,
                                         quantization_type="expert_wise_per_channel_symmetric",
                                         modules_to_not_convert=["self_attn", "router", "embed_tokens"])
                    config = g.Gemma4MoEInferenceConfig(nc, load_config=g.load_gemma4_config(model_dir))
                    net = g.NeuronGemma4MoEModel(config)
                    found[f"{name}/tp{tp}"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)]
                                               for k, v in net.state_dict().items() if not k.startswith("kv_mgr.")}
                finally:
                    parallel_state.destroy_model_parallel()
                    torch.distributed.destroy_process_group()
    return {"specs": found}


def route2(job: dict) -> dict:
    """What ``NeuronGemma4MoEForCausalLM.load_weights`` hands NxD's ``nxd_model.initialize`` on a
    Neuron host (g4's Route 2, ``g4_rank_weights``), for each result in ``results`` (TP degree ->
    directory) built with the settings ``g4serve --backend neuron`` compiles with
    (``neuron_backend.nxdi_settings(on_cpu=False)``, bf16, buckets from the manifest):

    - ``route2/tp{T}``: every rank's weights (``load_weights`` itself, with ``traced_model`` a recorder
      of ``nxd_model.initialize``: the traced model is Neuron-only), and one call per single rank
      (``start_rank_id=r, local_ranks_size=1``), as a multi-host load asks;
    - ``route1/tp1``: NxDI's own Route 1 for the TP-1 result: ``get_builder().shard_checkpoint()``
      (NxD ``trace/model_builder.py:802-843``: ``checkpoint_loader_fn`` -> ``get_state_dict``,
      NxDI's ``_cast_helper``, NxD's ``preprocess_checkpoint``, ``cast_weights`` and
      ``get_sharded_checkpoint``), which NxDI's ``load_weights`` initialises the device with;
    - ``refused/tp{T}``: the error for a rank file with one key renamed (a copy of the result).
    Tensors are returned as they are (dtype, shape, values)."""
    stubs.install_nxdi(job["nxd_src"], job["nxdi_src"])
    import shutil
    import types

    import torch
    from safetensors.torch import load_file, save_file

    from g4.exporters.neuron_int8 import Manifest, rank_file
    from g4.serve.neuron_backend import build_nxdi_model, nxdi_settings

    if torch.distributed.is_initialized():  # the gloo group of an earlier to_cpu() in this process
        torch.distributed.destroy_process_group()
    os.environ["NXD_CPU_MODE"] = "0"  # the mocked "xla" group has no gloo groups

    class Recorder:  # stands in for the Neuron-only NxDModel (torch.classes.neuron.SPMDModel)
        def initialize(self, weights, start_rank):
            self.weights, self.start_rank = weights, start_rank

    def build(path):
        path = Path(path)
        settings = nxdi_settings(Manifest.from_dir(path), json.loads((path / "config.json").read_text()),
                                 on_cpu=False, dtype="bfloat16")
        return build_nxdi_model(path, settings)

    found = {}
    for tp, path in job["results"].items():
        model = build(path)
        model.traced_model = types.SimpleNamespace(nxd_model=Recorder())
        model.load_weights("unused-compiled-path")
        rec = model.traced_model.nxd_model
        found[f"route2/tp{tp}"] = {"weights": rec.weights, "start_rank": rec.start_rank.tolist(),
                                   "single": [model.g4_rank_weights(r, 1)[0] for r in range(int(tp))]}
        if int(tp) == 1:
            found["route1/tp1"] = build(path).get_builder().shard_checkpoint()
        bad = Path(job["scratch"]) / f"renamed-tp{tp}"
        shutil.copytree(path, bad)
        sd = load_file(bad / rank_file(0))
        key = sorted(k for k in sd if k.endswith("mlp.down_proj.scale"))[0]
        sd[key.replace("down_proj", "down_projection")] = sd.pop(key)
        save_file(sd, bad / rank_file(0))
        try:
            build(bad).g4_rank_weights(0, 1)
            found[f"refused/tp{tp}"] = None
        except Exception as e:  # noqa: BLE001 - the test asserts which
            found[f"refused/tp{tp}"] = f"{type(e).__name__}: {e}"
    return found


def run(job: dict) -> dict:
    t = time.perf_counter()
    try:
        kind = job.get("kind")
        result = (specs(job) if kind == "specs" else engine(job) if kind == "engine" else batch(job)
                  if kind == "batch" else route2(job) if kind == "route2" else main(job))
    except Exception as e:  # reported, with where, to the test
        result = {"error": f"{type(e).__name__}: {e}", "where": traceback.format_exc()[-4000:]}
    result["wall_s"] = time.perf_counter() - t
    import torch

    rank = os.environ.get("RANK") if job.get("tp", 1) > 1 else None
    torch.save(result, job["result"] + (f".rank{rank}" if rank is not None else ""))
    return result


if __name__ == "__main__":
    # one job, or a list of jobs of one TP degree run one after another in this process (one import
    # of NxDI): between them NxD's model-parallel state is torn down (parallel_layers/parallel_state.py:
    # destroy_model_parallel) so that the next to_cpu() initialises it afresh (at TP > 1 each job
    # also ends with barrier + destroy_process_group, so the next to_cpu opens the gloo group again)
    # a hung worker (a rank waiting on a collective its peer never joins) writes every thread's stack
    # into its log and exits 1 before the lane's wait gives up on it (LANE_HANG_S, set by the lane)
    faulthandler.dump_traceback_later(float(os.environ.get("LANE_HANG_S", "200")), exit=True)
    jobs = json.loads(Path(sys.argv[1]).read_text())
    for i, job in enumerate(jobs if isinstance(jobs, list) else [jobs]):
        if i:
            from neuronx_distributed.parallel_layers import parallel_state

            parallel_state.destroy_model_parallel()
        result = run(job)
        if "error" in result and job.get("tp", 1) > 1:
            # its peer rank may still wait in this job's collectives: going on to the next job's
            # rendezvous would hang both, so the group ends here (the lane reports this log)
            print(f"job {job['result']}: {result['where']}", file=sys.stderr, flush=True)
            sys.exit(3)
    sys.exit(0)
