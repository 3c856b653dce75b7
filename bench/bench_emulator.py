"""Peak RSS and seconds per token of the int8-neuron CPU engine (the tensor-parallel emulator
behind `g4serve` on the CPU and `g4serve check`) on a synthetic gemma-4-26B-A4B (real names and
shapes, random bf16 weights) converted with `g4convert int8-neuron --tp T`, against the bound
4 GiB + one decoder layer and against the result's size on disk.

    python bench/bench_emulator.py [--layers 2] [--tp 2] [--work bench/_work] [--tokens 4]
                                   [--stream auto|on|off] [--pythonpath DIR]

The source is made once with `g4convert synth` and the result once with `g4convert int8-neuron`;
both are reused. The engine runs in a child process as `/usr/bin/time -v python -c ...`:
`g4.serve.engine.load_cpu_engine(OUT, stream=...)` (`auto`: the engine's own choice by available
memory), then one chat prompt and `--tokens - 1` greedy steps through `Engine.start` /
`Engine.step` (stop ids ignored: the weights are random), each step timed; its "Maximum resident
set size" is reported. `--pythonpath DIR` puts DIR first on the child's PYTHONPATH, to measure
another checkout's code on the same files (DIR must hold a `g4` package whose `convert`,
`exporters`, `quantizers` and `serve` are that checkout's folders, as for bench_verify.py); the
generated ids and the sha256 of the last logits are printed so that two runs can be compared.

"One layer" is the bf16 source's largest decoder layer, as bench_verify.py and bench_eval.py
count it. The emulator recomputes the whole sequence every step (no KV cache), so a step reads
(streamed) or dequantizes every layer once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

GIB = 2**30

DRIVER = r"""
import hashlib, json, sys, time
import torch
from g4.serve.chat import render_prompt
from g4.serve.engine import load_cpu_engine
out, stream, tokens = sys.argv[1], {"auto": None, "on": True, "off": False}[sys.argv[2]], int(sys.argv[3])
t = time.perf_counter()
engine = load_cpu_engine(out, stream=stream)
load = time.perf_counter() - t
prompt = render_prompt(engine.tokenizer, [{"role": "user", "content": "Write one sentence about the sea."}])
ids, steps = [], []
with torch.no_grad():
    t = time.perf_counter()
    state, logits = engine.start(prompt)
    steps.append(time.perf_counter() - t)
    for _ in range(tokens - 1):
        ids.append(int(logits.argmax()))
        t = time.perf_counter()
        state, logits = engine.step(state, ids[-1])
        steps.append(time.perf_counter() - t)
ids.append(int(logits.argmax()))
print(json.dumps({"description": engine.description, "load_s": load, "step_s": steps, "prompt_tokens": len(prompt),
                  "ids": ids, "last_logits_sha256": hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()}))
"""


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(__file__).parent / "_work")
    ap.add_argument("--tokens", type=int, default=4, help="generated tokens (the first comes from the prompt)")
    ap.add_argument("--stream", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--pythonpath", type=Path, help="measure the g4 package found here (e.g. an older checkout)")
    args = ap.parse_args()
    from g4.core.checkpoint import Checkpoint
    from g4.serve.neuron_emulator import whole_model_bytes

    g4convert = [sys.executable, "-m", "g4.convert.cli", "-q"]
    src = args.work / f"synth-26b-{args.layers}L"
    out = args.work / f"synth-26b-{args.layers}L-int8-tp{args.tp}"
    args.work.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        _run([*g4convert, "synth", "--layers", str(args.layers), str(src)])
    if not out.exists():
        _run([*g4convert, "int8-neuron", "--tp", str(args.tp), str(src), str(out)])
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.pythonpath), env.get("PYTHONPATH")]))
    res = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", DRIVER, str(out), args.stream, str(args.tokens)],
                         capture_output=True, text=True, env=env)
    if res.returncode:
        sys.exit(f"the engine failed ({res.returncode}):\n{res.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1)) * 1024
    report = json.loads(res.stdout.strip().splitlines()[-1])

    ck = Checkpoint(src)
    layer_bytes = max(sum(i.nbytes for n, i in ck.tensors.items() if n.startswith(ck.layer_prefix(L)))
                      for L in range(ck.num_layers))
    bound = 4 * GIB + layer_bytes
    on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    steps = report["step_s"]
    print(json.dumps({
        "layers": args.layers, "tp": args.tp, "stream": args.stream,
        "code": str(args.pythonpath or "this checkout"),
        "engine": report["description"],
        "result_on_disk_GiB": round(on_disk / GIB, 3),
        "whole_model_bytes_GiB (this checkout's rule)": round(whole_model_bytes(out) / GIB, 3),
        "one_layer_GiB (bf16 source)": round(layer_bytes / GIB, 3),
        "peak_rss_GiB": round(rss / GIB, 3),
        "peak_rss / result on disk": round(rss / on_disk, 3),
        "peak_rss / (4 GiB + one layer)": round(rss / bound, 3),
        "rss_within_bound": rss <= bound,
        "load_s": round(report["load_s"], 1),
        "prompt_tokens": report["prompt_tokens"],
        "first_token_s": round(steps[0], 1),
        "later_tokens_s": [round(s, 1) for s in steps[1:]],
        "ids": report["ids"], "last_logits_sha256": report["last_logits_sha256"],
    }, indent=2))


if __name__ == "__main__":
    main()
