"""NVFP4 quality by algorithm, g4 against modelopt, in one run and one table.

    python bench/bench_quality.py [--model DIR] [--work bench/_work/quality] [--max-tokens 4096] [--ctx 512]
                                  [--calib-samples 32] [--calib-seq-len 256] [--no-modelopt]

Rows: every algorithm ``g4convert nvfp4 --algorithm`` offers (read from the CLI's own choices, so a
new algorithm needs no edit here; ``max`` alone where the option does not exist yet) x {W4A4,
W4A16}, then modelopt 0.47's NVFP4 configs that run on the CPU (``mtq.quantize`` on the whole
transformers model with the same calibration tokens, then ``export_hf_checkpoint``, as
``tests/convert/test_convert_nvfp4.py::test_bit_identical_to_modelopt_export`` does); a config that fails
on the CPU is listed with its error. Every result is evaluated by ``g4convert eval``'s code
(``g4.convert.evaluate``: the same chunks of the packaged held-out text, llama.cpp's statistics,
W4A4 with activation emulation) against the same source in this run. Columns: mean / median /
99% / 99.9% KLD (nats), top-1 agreement, PPL ratio, conversion seconds per decoder layer (g4: the
whole ``convert_nvfp4``; modelopt: ``mtq.quantize`` + export), weight bytes on disk. One more row,
"source weights, max's activations": the source's own weights with g4 max's W4A4 activation
quantization, the W4A4 KLD no weight algorithm can go below (printed as a share of max's).

The model: ``--model DIR``, default the trained quality test model ``bench/_work/quality-model``
(``bench/quality_model.py`` builds it) when it is there, else the embedded model (its figures rank
nothing: it learnt twelve facts, not English). Change :data:`QUALITY_MODEL` to move the default.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

QUALITY_MODEL = Path(__file__).parent / "_work" / "quality-model"
# modelopt 0.47 configs for NVFP4 on this model: (label, config name, W4A4)
MODELOPT_CONFIGS = (("modelopt max (NVFP4_DEFAULT_CFG)", "NVFP4_DEFAULT_CFG", True),
                    ("modelopt mse fp8 sweep", "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", True),
                    ("modelopt local_hessian", "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG", True),
                    ("modelopt awq_lite", "NVFP4_AWQ_LITE_CFG", True),
                    ("modelopt awq_clip", "NVFP4_AWQ_CLIP_CFG", True),
                    ("modelopt W4A16 (W4A16_NVFP4_CFG)", "W4A16_NVFP4_CFG", False))


def g4_algorithms() -> list[str]:
    """The choices of ``g4convert nvfp4 --algorithm`` (``["max"]`` before the option exists)."""
    import click

    from g4.convert.cli import nvfp4

    for p in nvfp4.params:
        if p.name == "algorithm" and isinstance(p.type, click.Choice):
            return list(p.type.choices)
    return ["max"]


def weight_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*.safetensors"))


def run_modelopt(src: Path, out: Path, cfg_name: str, ids: torch.Tensor) -> float:
    """modelopt's calibration and export of ``src`` into ``out``; seconds."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForImageTextToText, AutoModelForCausalLM

    from g4.core.checkpoint import read_json_object

    cls = AutoModelForImageTextToText if read_json_object(src / "config.json").get("model_type") == "gemma4" \
        else AutoModelForCausalLM
    model = cls.from_pretrained(src, dtype=torch.bfloat16, attn_implementation="sdpa",
                                experts_implementation="eager").eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        mtq.quantize(model, getattr(mtq, cfg_name), lambda m: [m(input_ids=ids[i : i + 8]) for i in range(0, len(ids), 8)])
    export_hf_checkpoint(model, export_dir=out)
    return time.perf_counter() - t0


def evaluate_activations_only(src: Path, w4a4: Path, chunks: torch.Tensor) -> dict:
    """``g4convert eval``'s statistics of the source's own (bf16) weights with the NVFP4 activation
    quantization of the W4A4 result ``w4a4`` (its ``input_scale``s, the same emulation): the KLD that
    W4A4 keeps whatever a weight algorithm does, since the weights can do no better than exact."""
    from g4.convert.evaluate import compare_on_chunks, summarize
    from g4.convert.stream import Nvfp4Stream, SourceStream

    class ActivationsOnly(SourceStream):
        def __init__(self):
            super().__init__(src, torch.bfloat16)
            self.scales = Nvfp4Stream(w4a4, torch.bfloat16, act_quant=True)

        def layer_tensors(self, layer: int):
            return super().layer_tensors(layer)[0], self.scales.layer_tensors(layer)[1]

    return summarize(compare_on_chunks(SourceStream(src, torch.bfloat16), ActivationsOnly(), chunks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="source checkpoint (default: the quality test model, else embedded)")
    ap.add_argument("--work", type=Path, default=Path(__file__).parent / "_work" / "quality")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--no-modelopt", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from g4.convert.calibrate import make_calibration_ids, read_calibration_texts
    from g4.core.checkpoint import Checkpoint
    from g4.convert.evaluate import DEFAULT_TEXT_FILE, compare_on_chunks, eval_chunks, summarize
    from g4.convert.nvfp4 import convert_nvfp4
    from g4.convert.resolve import EMBEDDED_DIR
    from g4.convert.stream import Nvfp4Stream, SourceStream

    src = args.model or (QUALITY_MODEL if QUALITY_MODEL.is_dir() else EMBEDDED_DIR)
    layers = Checkpoint(src, source=True).num_layers
    tok = AutoTokenizer.from_pretrained(src)
    chunks, _ = eval_chunks(tok, read_calibration_texts(DEFAULT_TEXT_FILE, what="evaluation"), ctx=args.ctx,
                            max_tokens=args.max_tokens, text_name=DEFAULT_TEXT_FILE.name)
    calib = make_calibration_ids(tok, read_calibration_texts(None), samples=args.calib_samples,
                                 seq_len=args.calib_seq_len)
    print(f"model {src.name if src != EMBEDDED_DIR else 'embedded'} ({layers} layers); eval: "
          f"{chunks.shape[0]} chunks of {args.ctx} of {DEFAULT_TEXT_FILE.name}; calibration {calib.shape[0]} x "
          f"{calib.shape[1]} tokens of calibration.jsonl (the converters' default)", flush=True)
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    bf16_bytes = weight_bytes(src)

    def evaluate(out: Path, w4a4: bool) -> dict:
        s = SourceStream(src, torch.bfloat16)
        r = Nvfp4Stream(out, torch.bfloat16, act_quant=w4a4)
        return summarize(compare_on_chunks(s, r, chunks))

    rows = []
    algorithms = g4_algorithms()
    for algo in algorithms:
        for w4a4 in (True, False):
            out = args.work / f"g4-{algo}-{'w4a4' if w4a4 else 'w4a16'}"
            kw = {"algorithm": algo} if algorithms != ["max"] else {}
            t0 = time.perf_counter()
            convert_nvfp4(src, out, weight_only=not w4a4, calib_samples=args.calib_samples,
                          calib_seq_len=args.calib_seq_len, progress=False, **kw)
            seconds = time.perf_counter() - t0
            rows.append((f"g4 {algo}", "W4A4" if w4a4 else "W4A16", evaluate(out, w4a4), seconds / layers,
                         weight_bytes(out)))
            print(f"  done: g4 {algo} {'W4A4' if w4a4 else 'W4A16'}", flush=True)
    floor = None
    if (args.work / "g4-max-w4a4").is_dir():
        floor = evaluate_activations_only(src, args.work / "g4-max-w4a4", chunks)
        rows.append(("source weights, max's activations", "A4 only", floor, None, None))
        print("  done: activations only", flush=True)
    if not args.no_modelopt:
        for label, cfg, w4a4 in MODELOPT_CONFIGS:
            out = args.work / f"modelopt-{cfg}"
            try:
                seconds = run_modelopt(src, out, cfg, calib)
                rows.append((label, "W4A4" if w4a4 else "W4A16", evaluate(out, w4a4), seconds / layers,
                             weight_bytes(out)))
            except Exception as e:  # a modelopt config that does not run here: listed with its error
                rows.append((label, "W4A4" if w4a4 else "W4A16", f"did not run: {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:100] if str(e) else ''}", None, None))
            print(f"  done: {label}", flush=True)

    print()
    print("| algorithm | act | mean KLD | median | 99% | 99.9% | top-1 | PPL ratio | s/layer | size (vs bf16) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, act, r, spl, size in rows:
        if isinstance(r, str):
            print(f"| {name} | {act} | {r} | | | | | | | |")
            continue
        u, k = r["uncertainty"], r["kld"]
        tail = f"{spl:.2f} | {size / 1e6:.3f} MB ({size / bf16_bytes:.3f}x)" if size is not None else "- | -"
        print(f"| {name} | {act} | {k['mean']:.5f} ± {u['kld_mean']:.5f} | {k['median']:.5f} | {k['p99']:.4f} | "
              f"{k['p999']:.4f} | {100 * r['top1_agreement']:.2f} ± {100 * u['top1_agreement']:.2f} % | "
              f"{r['ppl_ratio']:.4f} ± {u['ppl_ratio']:.4f} | {tail} |")
    print(f"\n{rows[0][2]['tokens'] if not isinstance(rows[0][2], str) else '?'} tokens scored per row; "
          "± one standard error (llama.cpp's); W4A4 rows with activation emulation.")
    if floor is not None:
        base = next(r for name, act, r, _, _ in rows if name == "g4 max" and act == "W4A4")
        print(f"W4A4 floor of every weight algorithm (the source's own weights, NVFP4 activations against max's "
              f"input_scales): mean KLD {floor['kld']['mean']:.5f}, {100 * (1 - floor['kld']['mean'] / base['kld']['mean']):.0f}% "
              f"below g4 max's W4A4 {base['kld']['mean']:.5f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
