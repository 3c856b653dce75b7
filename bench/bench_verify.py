"""Peak RSS of `g4convert verify` on a synthetic gemma-4-26B-A4B (real names and shapes, random bf16
weights) converted with `g4convert nvfp4 --weight-only`, against the bound 4 GiB + one decoder
layer, with a projection to the real model's 30 layers.

    python bench/bench_verify.py [--layers 2] [--work bench/_work] [--max-new-tokens 4]
                                 [--pythonpath DIR]

The source is made once with `g4convert synth` and the result once with `g4convert nvfp4
--weight-only`; both are reused. verify runs as `/usr/bin/time -v g4convert verify ...` in a child
process and its "Maximum resident set size" is reported. `--pythonpath DIR` puts DIR first on the
child's PYTHONPATH, to measure another checkout's code on the same files (DIR must hold a `g4`
package whose `convert`, `exporters`, `quantizers` and `serve` are that checkout's folders).

The layer-streaming verify holds one decoder layer (source, then result dequantized, never both)
or the head, besides the per-prompt state; of that state only the KV caches of the greedy
continuation grow with the layer count, so the 30-layer projection adds their size for the
missing layers (computed from the config and the prompts' token counts). Seconds are projected
by bytes read (source plus result), as bench_convert.py projects them.

verify runs twice, both from the same page-cache state (``--cache``): first with an empty cache of
SRC's side (``G4_SOURCE_CACHE``, a temporary folder: SRC's continuations and hidden states
computed and kept), then again with it (``g4.convert.stream.SourceSideCache``: none of SRC's
decoder layers read), as a second result verified against the same SRC would run; printed: both
runs and the second's seconds and bytes read as ratios to the first's (same report checked).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(__file__).parent / "_work")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--pythonpath", type=Path, help="measure the g4 package found here (e.g. an older checkout)")
    ap.add_argument("--cache", choices=["cold", "warm"], default="cold",
                    help="page-cache state of the source's and result's files at the start (bench_convert.settle)")
    args = ap.parse_args()
    from bench_convert import disk_read_bytes, settle
    from g4.core.checkpoint import Checkpoint

    g4convert = [sys.executable, "-m", "g4.convert.cli", "-q"]
    src = args.work / f"synth-26b-{args.layers}L"
    out = args.work / f"synth-26b-{args.layers}L-nvfp4-wo"
    args.work.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        _run([*g4convert, "synth", "--layers", str(args.layers), str(src)])
    if not out.exists():
        _run([*g4convert, "nvfp4", "--weight-only", str(src), str(out)])
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.pythonpath), env.get("PYTHONPATH")]))
    ck, out_ck = Checkpoint(src), Checkpoint(out)
    results = []
    with tempfile.TemporaryDirectory(prefix="g4-source-cache-") as cache:
        for _ in range(2):
            settle(src, args.cache)
            settle(out, args.cache)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            res = subprocess.run(["/usr/bin/time", "-v", *g4convert, "verify", str(out), "--against", str(src),
                                  "--max-new-tokens", str(args.max_new_tokens), "--min-agreement", "0", "--json"],
                                 capture_output=True, text=True, env={**env, "G4_SOURCE_CACHE": cache})
            seconds = time.perf_counter() - t
            read = disk_read_bytes(before, resource.getrusage(resource.RUSAGE_CHILDREN))
            if res.returncode:
                sys.exit(f"verify failed ({res.returncode}):\n{res.stderr[-3000:]}")
            rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1)) * 1024
            results.append((seconds, read, rss, json.loads(res.stdout)))
            _print(args, ck, out_ck, *results[-1])
    (s1, r1, _, first), (s2, r2, _, second) = results
    same = {k: v for k, v in first.items() if k != "src_side_from_cache"} == {
        k: v for k, v in second.items() if k != "src_side_from_cache"}
    print(f"second run against the first: {s2 / s1:.2f}x the seconds, {r2 / max(r1, 1):.2f}x the bytes read; "
          f"SRC's side from the cache: {second.get('src_side_from_cache')}; same report: {same}")


def _print(args, ck, out_ck, seconds: float, read: int, rss: int, report: dict) -> None:
    from g4.core.gemma4 import read_architecture
    from g4.convert.synth import synthetic_config, synthetic_specs

    layer_bytes = max(sum(i.nbytes for n, i in ck.tensors.items() if n.startswith(ck.layer_prefix(L)))
                      for L in range(ck.num_layers))
    bound = 4 * GIB + layer_bytes
    # KV caches: every layer keeps K and V of every token of every prompt (the sliding window,
    # 1024 tokens, is longer than any prompt here), in bf16.
    tokens = report["all_positions"] + report["prompts"]  # positions are S - 1 per sequence

    def kv_bytes(arch) -> int:
        return sum(2 * att.kv_heads * att.head_dim for att in arch.layers) * tokens * 2

    real = synthetic_config("gemma-4-26B-A4B")
    projected_rss = rss + kv_bytes(read_architecture(real)) - kv_bytes(ck.arch)
    bytes_read = sum(i.nbytes for i in ck.tensors.values()) + sum(i.nbytes for i in out_ck.tensors.values())
    real_src = sum(s.nbytes for s in synthetic_specs(real))
    real_read = real_src * bytes_read / sum(i.nbytes for i in ck.tensors.values())
    print(json.dumps({
        "layers": args.layers,
        "code": str(args.pythonpath or "this checkout"),
        "prompts": report["prompts"], "max_new_tokens": args.max_new_tokens,
        "layer_rel_error": [round(e, 4) for e in report.get("layer_rel_error", [])],
        "seconds": round(seconds, 1),
        "src_side_from_cache": report.get("src_side_from_cache"),
        "source_cache": args.cache,
        # bytes read from the disk over the bytes of both checkpoints' tensors (cold: how many times
        # verify read them; ru_inblock of the child)
        "read_from_disk_GB": round(read / 1e9, 3),
        "src_plus_out_GB": round(bytes_read / 1e9, 3),
        "reads_of_src_plus_out": round(read / bytes_read, 2),
        "one_layer_GiB": round(layer_bytes / GIB, 3),
        "peak_rss_GiB": round(rss / GIB, 3),
        "rss_bound_GiB (4 GiB + one layer)": round(bound / GIB, 3),
        "rss_within_bound": rss <= bound,
        "projected_30_layer_peak_rss_GiB": round(projected_rss / GIB, 3),
        "projected_30_layer_seconds": round(seconds * real_read / bytes_read),
    }, indent=2))


if __name__ == "__main__":
    main()
