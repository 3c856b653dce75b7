"""Decode with several requests at once against one at a time, in the same run: g4serve's
``NeuronEngine`` in NxD Inference 0.8's CPU mode at ``--max-batch-size 1`` and ``--max-batch-size B``
(NxDI's continuous batching), on an int8-neuron result.

    python bench/bench_nxdi_batch.py [SRC] [--batch 4] [--tokens 24] [--seq-len 64] [--threads N]

SRC (default ``embedded``, the tiny trained Gemma 4) is converted with ``g4convert int8-neuron --tp 1
--seq-len N`` into a temporary folder (in a subprocess: NxDI imports only with transformers 4.57,
the converter runs with the package's transformers). Then, for batch 1 and for batch B, B requests
(chat prompts of the embedded model's questions, or seeded random ids for another SRC) each decode
``--tokens`` tokens greedily through ``start``, ``step`` and ``finish``, each in its own thread as
the server's workers run them (at batch 1 the batcher runs them one after another). Timed: the
token-generation calls themselves, summed; the context encodings are not counted.

Printed per batch size: token-generation calls, decode tokens/s in all and per sequence, ms per
call, the KV cache bytes NxDI allocated (``kv_mgr.past_key_values`` of the token-generation model;
on the CPU NxDI's continuous batching keeps a second copy in the context-encoding model, not
counted: on Neuron both share one cache) and those bytes per token of capacity (B x ``max_length``);
then batch B over batch 1 as ratios. A CPU figure: on NeuronCores the token-generation call is a
compiled graph and its time per call depends on B differently.

Needs what ``bench/bench_nxdi_decode.py`` needs (the NxD / NxDI sources and the transformers 4.57
overlay); exits with one ``error:`` line when one is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from bench_nxdi_decode import NXD_SRC, NXDI_SRC, OVERLAY, REPO, missing

MIB = 2**20


def convert(src: str, out: Path, seq_len: int) -> None:
    """``g4convert int8-neuron SRC OUT --tp 1 --seq-len N`` in a subprocess (exits on its error)."""
    r = subprocess.run([sys.executable, "-c", "from g4.convert.cli import main; main()", "int8-neuron", src, str(out),
                        "--tp", "1", "--seq-len", str(seq_len), "-q"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit((r.stderr.strip().splitlines() or ["error: g4convert int8-neuron failed"])[-1])


PROMPTS_SCRIPT = """
import json, sys
import torch
from transformers import AutoTokenizer
from g4.convert.embedded_model import FACTS
out, count, longest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(out)
ids = []
for i in range(count):
    p = tok.apply_chat_template([{"role": "user", "content": FACTS[i % len(FACTS)][0]}], add_generation_prompt=True,
                                tokenize=True, return_dict=True)["input_ids"]
    if len(p) > longest:
        p = torch.randint(3, 100, (longest,), generator=torch.Generator().manual_seed(i)).tolist()
    ids.append(list(p))
print(json.dumps(ids))
"""


def prompts(out: Path, count: int, longest: int) -> list[list[int]]:
    """``count`` prompts of at most ``longest`` ids, with the result's tokenizer (in a subprocess,
    under the package's transformers): chat prompts of the embedded model's questions, seeded
    random ids where one is longer."""
    r = subprocess.run([sys.executable, "-c", PROMPTS_SCRIPT, str(out), str(count), str(longest)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: {out}: cannot build prompts with its tokenizer: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def run(engine, batch: list[list[int]], tokens: int) -> dict:
    """Every prompt of ``batch`` in its own thread, ``tokens`` greedy tokens each. Timed: the
    token-generation calls themselves (summed), so the context encodings, which at batch 1 come
    between one request's decode and the next, are not counted."""
    spent, errors = [], []
    decode = engine.batcher._decode  # the engine's token-generation call, as the batcher runs it

    def timed(rows):
        t = time.perf_counter()
        try:
            return decode(rows)
        finally:
            spent.append(time.perf_counter() - t)

    engine.batcher._decode = timed
    gate = threading.Barrier(len(batch))

    def one(prompt):
        try:
            gate.wait()
            state, logits = engine.start(prompt)
            try:
                for _ in range(tokens - 1):
                    state, logits = engine.step(state, int(logits.argmax()))
            finally:
                engine.finish(state)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(p,)) for p in batch]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.batcher._decode = decode
    if errors:
        raise SystemExit(f"error: decode failed: {errors[0]}")
    t_decode, calls = sum(spent), len(spent)
    decoded = len(batch) * (tokens - 1)
    kv = engine.model.token_generation_model.model.kv_mgr.past_key_values
    kv_bytes = sum(p.numel() * p.element_size() for p in kv)
    # a sequence advances one token per call it is in: per sequence, calls per second
    return {"calls": calls, "rows": decoded / calls, "tok_s": decoded / t_decode, "tok_s_seq": calls / t_decode,
            "ms_call": t_decode / calls * 1e3, "kv_bytes": kv_bytes,
            "kv_per_token": kv_bytes / (engine.max_batch_size * engine.max_length)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", nargs="?", default="embedded", help="checkpoint to convert (default: embedded)")
    ap.add_argument("--batch", type=int, default=4, help="requests at once (B) compared with batch 1")
    ap.add_argument("--tokens", type=int, default=24, help="tokens each request decodes (>= 2)")
    ap.add_argument("--seq-len", type=int, default=64, help="the result's max_length (prompt plus reply)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.batch < 2 or args.tokens < 2 or args.seq_len < args.tokens + 1:
        raise SystemExit("error: --batch and --tokens must be >= 2, and --seq-len above --tokens")
    why = missing()
    if why:
        raise SystemExit(f"error: {why}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="g4-bench-batch-") as tmp:
        out = Path(tmp) / "int8"
        convert(args.src, out, args.seq_len)
        batch = prompts(out, args.batch, args.seq_len - args.tokens)
        os.environ.setdefault("NXD_LOG_LEVEL", "warning")  # NxD's process-group set-up logs at info
        warnings.filterwarnings("ignore")  # NxDI 0.8's deprecation warnings under torch 2.13
        sys.path.insert(0, str(OVERLAY))  # NxDI 0.8's transformers, before anything imports transformers
        sys.path.insert(0, str(REPO / "tests" / "lanes"))
        from nxd_cpu import stubs

        stubs.install_nxdi(str(NXD_SRC), str(NXDI_SRC))
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        from g4.serve.neuron_backend import load_neuron_engine

        found = {}
        for size in (1, args.batch):
            engine = load_neuron_engine(out, on_cpu=True, max_batch_size=size, log=lambda line: None)
            run(engine, batch[:1], 2)  # warm-up: first-call allocations
            found[size] = run(engine, batch, args.tokens)
            del engine
    one, many = found[1], found[args.batch]
    print(f"g4serve NeuronEngine, NxDI 0.8 CPU mode, int8-neuron of {args.src} (TP 1, max_length {args.seq_len}); "
          f"{args.batch} requests x {args.tokens - 1} decode steps; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'max batch':>9} {'tkg calls':>9} {'rows/call':>9} {'tokens/s, all':>14} {'tokens/s/seq':>13} {'ms/call':>8} "
          f"{'KV MiB':>8} {'KV bytes/token':>15}")
    for size, r in found.items():
        print(f"{size:>9} {r['calls']:>9} {r['rows']:>9.2f} {r['tok_s']:>14.1f} {r['tok_s_seq']:>13.1f} {r['ms_call']:>8.1f} "
              f"{r['kv_bytes'] / MIB:>8.2f} {r['kv_per_token']:>15.0f}")
    print(f"batch {args.batch} / batch 1: {many['tok_s'] / one['tok_s']:.2f}x tokens/s in all, "
          f"{many['tok_s_seq'] / one['tok_s_seq']:.2f}x per sequence, {many['ms_call'] / one['ms_call']:.2f}x time "
          f"per token-generation call, {many['kv_per_token'] / one['kv_per_token']:.2f}x KV bytes per token "
          f"({many['kv_bytes'] / one['kv_bytes']:.2f}x allocated)")
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
