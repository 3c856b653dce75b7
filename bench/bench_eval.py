"""Time and peak RSS of `g4convert eval` on a synthetic gemma-4-26B-A4B (real names and shapes,
random bf16 weights) converted with `g4convert nvfp4 --weight-only`, against the bound 4 GiB + one
decoder layer, with the time extrapolated to the real model's 30 layers.

    python bench/bench_eval.py [--layers 2] [--work bench/_work] [--max-tokens 4096] [--ctx 512]

The source and result are made once (`g4convert synth`, `g4convert nvfp4 --weight-only`; the
files bench_verify.py uses) and reused. eval runs as `/usr/bin/time -v g4convert eval ...` in a
child process. The projection: the measured seconds minus the head phase, per decoder layer, times
30, plus the head phase (which does not grow with depth); the 26B's real text statistics are not
measured here (random weights), only its cost. Memory does not grow with depth (one layer at a
time; the hidden states of the chunks are the same for every layer count).

eval runs twice, both from the same page-cache state (``--cache``): first with an empty cache of
SRC's side (``G4_SOURCE_CACHE``, a temporary folder: SRC's side computed and kept), then
again with it (``g4.convert.stream.SourceSideCache``: SRC's decoder layers not read), as a
second result evaluated against the same SRC would run; printed: both runs and the second's
seconds and bytes read as ratios to the first's. The statistics of both are the same (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import re
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 2**30


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(__file__).parent / "_work")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--cache", choices=["cold", "warm"], default="cold",
                    help="page-cache state of the source's and result's files at the start (bench_convert.settle)")
    args = ap.parse_args()
    from bench_convert import disk_read_bytes, settle
    from g4.core.checkpoint import Checkpoint
    from g4.core.gemma4 import read_architecture

    g4convert = [sys.executable, "-m", "g4.convert.cli", "-q"]
    src = args.work / f"synth-26b-{args.layers}L"
    out = args.work / f"synth-26b-{args.layers}L-nvfp4-wo"
    args.work.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        _run([*g4convert, "synth", "--layers", str(args.layers), str(src)])
    if not out.exists():
        _run([*g4convert, "nvfp4", "--weight-only", str(src), str(out)])
    ckpt = Checkpoint(src)
    layer_bytes = max(sum(ckpt.tensors[n].nbytes for n in ckpt.tensors if n.startswith(ckpt.layer_prefix(L)))
                      for L in range(ckpt.num_layers))
    bound = 4 * GIB + layer_bytes
    arch = read_architecture(ckpt.config)
    both = sum(i.nbytes for i in ckpt.tensors.values()) + sum(i.nbytes for i in Checkpoint(out).tensors.values())
    runs = []
    with tempfile.TemporaryDirectory(prefix="g4-eval-cache-") as cache:
        for label in ("SRC's side computed (empty cache)", "SRC's side from the cache"):
            settle(src, args.cache)
            settle(out, args.cache)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = _run(["/usr/bin/time", "-v", *g4convert, "eval", str(out), "--against", str(src), "--json",
                         "--max-tokens", str(args.max_tokens), "--ctx", str(args.ctx)],
                        env={**os.environ, "G4_SOURCE_CACHE": cache})
            read = disk_read_bytes(before, resource.getrusage(resource.RUSAGE_CHILDREN))
            report = json.loads(proc.stdout)
            rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
            runs.append((report, read))
            head = report["head_seconds"]
            per_layer = (report["seconds"] - head) / args.layers  # everything but the head grows with depth
            print(f"eval of the {args.layers}-layer synthetic 26B-A4B (NVFP4 W4A16 vs bf16), {report['tokens']} "
                  f"tokens scored ({report['chunks']} chunks of {report['ctx']}), {report['dtype']} on "
                  f"{report['device']}, {label}")
            print(f"  {report['seconds']:.1f} s ({per_layer:.1f} s per layer, head phase {head:.1f} s); peak RSS "
                  f"{rss / GIB:.2f} GiB, bound 4 GiB + one layer = {bound / GIB:.2f} GiB: "
                  f"{'within' if rss <= bound else 'OVER'}")
            print(f"  read from the disk ({args.cache} cache at the start): {read / 1e9:.2f} GB = {read / both:.2f} x "
                  f"the source's and result's tensors ({both / 1e9:.2f} GB)")
            print(f"  extrapolated to 30 layers: {(per_layer * 30 + head) / 60:.1f} min (extrapolated, not measured; "
                  f"{arch.num_layers}-layer source)")
    (first, read1), (second, read2) = runs
    same = all(first[k] == second[k] for k in ("kld", "ppl_src", "ppl_out", "top1_agreement", "rms_dp", "tokens"))
    print(f"second run against the first: {second['seconds'] / first['seconds']:.2f}x the seconds, "
          f"{read2 / max(read1, 1):.2f}x the bytes read; SRC's side from the cache: "
          f"{second['src_hidden_from_cache']}; same statistics: {same}")

if __name__ == "__main__":
    main()
