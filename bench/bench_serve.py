"""Load test of the g4serve CPU server on loopback: N concurrent OpenAI clients against the
embedded tiny Gemma 4 converted to NVFP4 (or int8-neuron), every answer checked.

Prints requests/s, p50/p95 latency, completion tokens/s and the same figures for one
client in the same run (the reference), as ratios. Exits 1 if any answer is wrong or any
request is lost (error, timeout, or not sent before the deadline).

    python bench/bench_serve.py [--clients 8] [--requests 48] [--max-seconds 300]
                                [--format nvfp4|int8-neuron] [--out DIR]

The server generates one request at a time (one model, one KV cache): concurrency buys
overlap of HTTP, tokenization and queueing with generation, not parallel decoding, so
requests/s stays near the single-client figure while latency grows with the queue.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai

from g4.convert.embedded_model import EMBEDDED_DIR, load_facts
from g4.serve.engine import load_cpu_engine
from g4.serve.server import BackgroundServer, create_app

MODEL = "bench"


def convert(kind: str, out: Path) -> Path:
    if kind == "nvfp4":
        from g4.convert.nvfp4 import convert_nvfp4

        convert_nvfp4(EMBEDDED_DIR, out, progress=False)
    else:
        from g4.convert.int8_neuron import convert_int8_neuron

        convert_int8_neuron(EMBEDDED_DIR, out, tp=2, progress=False)
    return out


def one_request(client: openai.OpenAI, question: str, stream: bool) -> tuple[str, int]:
    """(content, completion tokens) of one greedy request."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=16)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage.completion_tokens
    content, tokens = [], 0
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            content.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return "".join(content), tokens


def load(url: str, facts: list[tuple[str, str]], clients: int, requests: int, deadline: float) -> dict:
    """``requests`` requests spread over ``clients`` threads (alternating streamed and not)."""
    latencies, tokens, wrong, lost = [], [], [], []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker():
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            if time.monotonic() > deadline:
                with lock:
                    lost.append((i, "not sent before the deadline"))
                continue
            question, answer = facts[i % len(facts)]
            t0 = time.perf_counter()
            try:
                content, n = one_request(client, question, stream=bool(i % 2))
            except Exception as e:  # any failure is a lost request
                with lock:
                    lost.append((i, f"{type(e).__name__}: {e}"))
                continue
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)
                tokens.append(n)
                if not content.strip().startswith(answer):
                    wrong.append((question, content, answer))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    lat = sorted(latencies)
    return {"clients": clients, "requests": requests, "answered": len(lat), "wrong": wrong, "lost": lost,
            "wall_s": wall, "req_per_s": len(lat) / wall, "tok_per_s": sum(tokens) / wall,
            "p50_s": statistics.median(lat) if lat else float("nan"),
            "p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else float("nan")}


def show(r: dict) -> str:
    return (f"{r['clients']:2d} client(s): {r['answered']}/{r['requests']} answered in {r['wall_s']:.1f} s, "
            f"{r['req_per_s']:.2f} req/s, p50 {r['p50_s'] * 1000:.0f} ms, p95 {r['p95_s'] * 1000:.0f} ms, "
            f"{r['tok_per_s']:.1f} completion tok/s, wrong {len(r['wrong'])}, lost {len(r['lost'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--requests", type=int, default=48, help="requests in the concurrent run (default 48)")
    ap.add_argument("--single-requests", type=int, default=12, help="requests in the one-client run (default 12)")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="deadline for each run (default 300 s)")
    ap.add_argument("--format", choices=["nvfp4", "int8-neuron"], default="nvfp4")
    ap.add_argument("--out", type=Path, help="an existing converted result (default: convert the embedded model)")
    args = ap.parse_args(argv)
    if not (1 <= args.clients <= 256 and 1 <= args.requests <= 10000 and args.single_requests >= 1):
        ap.error("--clients 1..256, --requests 1..10000, --single-requests >= 1")

    facts, _ = load_facts()
    with tempfile.TemporaryDirectory(prefix="g4-bench-serve-") as tmp:
        t0 = time.perf_counter()
        out = args.out or convert(args.format, Path(tmp) / args.format)
        engine = load_cpu_engine(out)
        print(f"result {out} ({engine.description}); ready in {time.perf_counter() - t0:.1f} s")
        with BackgroundServer(create_app(engine, served_model_name=MODEL, max_queue=max(64, args.clients))) as srv:
            one_request(openai.OpenAI(base_url=srv.url + "/v1", api_key="none"), facts[0][0], False)  # warm-up
            single = load(srv.url, facts, 1, args.single_requests, time.monotonic() + args.max_seconds)
            print(show(single))
            many = load(srv.url, facts, args.clients, args.requests, time.monotonic() + args.max_seconds)
            print(show(many))
    print(f"ratio {args.clients} clients / 1 client: requests/s x{many['req_per_s'] / single['req_per_s']:.2f}, "
          f"tokens/s x{many['tok_per_s'] / single['tok_per_s']:.2f}, "
          f"p50 latency x{many['p50_s'] / single['p50_s']:.2f}")
    bad = single["wrong"] + many["wrong"]
    lost = single["lost"] + many["lost"]
    for q, got, want in bad[:5]:
        print(f"WRONG {q!r} -> {got!r} (expected {want!r})")
    for i, why in lost[:5]:
        print(f"LOST request {i}: {why}")
    print("PASS: every answer correct, none lost" if not bad and not lost else
          f"FAIL: {len(bad)} wrong, {len(lost)} lost")
    return 0 if not bad and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
