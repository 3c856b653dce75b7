"""NVFP4 quantizer throughput on real-shaped Gemma 4 26B-A4B expert tensors, against
modelopt's NVFP4QTensor.quantize in the same run, with a bit-identity check.

    python bench/bench_quantizer.py [--repeats 5] [--threads 2]

Prints, per shape: our (the native AVX-512 kernel where it builds, else the compiled one) and
modelopt's best-of-N seconds (the least disturbed run on a shared machine), our Melem/s,
the speed ratio (modelopt time / ours, both timed in this run; the issue's target is
>= 10 on 2 cores), the same ratio for our torch.compile kernel (the native one off) and our
eager fallback (G4_NVFP4_EAGER=1), and whether every byte (packed codes, fp8 block scales,
global scale) of each is identical to modelopt's.
Then the same for ``quantize_experts`` on 8 experts of each expert shape (what a conversion
calls: one global scale per expert, a per-row scale inside the kernel) against modelopt
quantizing the experts one by one.
Last, g4's default algorithm, ``mse`` (no modelopt kernel runs it on a CPU: its fp8 scale sweep
needs triton): ``quantize_experts(method="mse")`` on the same 8 experts with our kernel (the native
one where it builds), against g4's eager mse kernel in the same run, the same ratio for our
torch.compile kernel, and whether the bytes of all three are identical.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

warnings.filterwarnings("ignore")

SHAPES = {"expert gate_up [1408, 2816]": (1408, 2816), "expert down [2816, 704]": (2816, 704),
          "dense mlp down [2816, 2112]": (2816, 2112)}
# quantize_experts on 8 of the 128 experts (modelopt's per-expert loop takes seconds per repeat)
EXPERT_SHAPES = {f"8 x {label}": (8, *shape) for label, shape in SHAPES.items()
                 if label.startswith("expert")}


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from g4.quantizers import nvfp4

    native = nvfp4.NATIVE.load()
    ours = "the native kernel" if native is not None else "the compiled kernel (the native one does not build here)"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeats}; ours: {ours}")
    print(f"{'shape':30s} {'ours s':>8s} {'modelopt s':>10s} {'ours Melem/s':>12s} {'ratio':>6s} "
          f"{'compiled ratio':>14s} {'eager ratio':>11s}  bit-identical")
    for label, shape in SHAPES.items():
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
        ref_q, ref_s, ref_g = NVFP4QTensor.quantize(w.clone(), 16)

        def same(ours):
            return (torch.equal(ours.weight, ref_q._quantized_data)
                    and torch.equal(ours.weight_scale.view(torch.uint8), ref_s.view(torch.uint8))
                    and torch.equal(ours.weight_scale_2, ref_g.reshape(())))

        identical = same(nvfp4.quantize(w))
        t_ours = best_seconds(lambda: nvfp4.quantize(w), args.repeats)
        nvfp4.NATIVE.function = None  # the compiled kernel
        identical = identical and same(nvfp4.quantize(w))
        t_compiled = best_seconds(lambda: nvfp4.quantize(w), args.repeats)
        fused = nvfp4.KERNEL.compiled
        nvfp4.KERNEL.compiled = None  # the eager fallback
        identical = identical and same(nvfp4.quantize(w))
        t_eager = best_seconds(lambda: nvfp4.quantize(w), args.repeats)
        nvfp4.KERNEL.compiled, nvfp4.NATIVE.function = fused, native
        t_ref = best_seconds(lambda: NVFP4QTensor.quantize(w.clone(), 16), args.repeats)
        print(f"{label:30s} {t_ours:8.4f} {t_ref:10.4f} {w.numel() / t_ours / 1e6:12.1f} {t_ref / t_ours:6.2f} "
              f"{t_ref / t_compiled:14.2f} {t_ref / t_eager:11.2f}  {identical}")
    # what a conversion calls for a layer's experts: quantize_experts, one global scale per expert
    # (a per-row scale inside the kernel), against modelopt quantizing expert by expert
    for label, shape in EXPERT_SHAPES.items():
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
        ours = nvfp4.quantize_experts(w)
        refs = [NVFP4QTensor.quantize(w[e].clone(), 16) for e in range(len(w))]
        identical = all(torch.equal(ours.weight[e], q._quantized_data)
                        and torch.equal(ours.weight_scale[e].view(torch.uint8), s.view(torch.uint8))
                        and torch.equal(ours.weight_scale_2[e], g.reshape(())) for e, (q, s, g) in enumerate(refs))
        t_ours = best_seconds(lambda: nvfp4.quantize_experts(w), args.repeats)
        nvfp4.NATIVE.function = None
        t_compiled = best_seconds(lambda: nvfp4.quantize_experts(w), args.repeats)
        nvfp4.NATIVE.function = native
        t_ref = best_seconds(lambda: [NVFP4QTensor.quantize(w[e].clone(), 16) for e in range(len(w))],
                             max(1, args.repeats // 3))
        print(f"{label:30s} {t_ours:8.4f} {t_ref:10.4f} {w.numel() / t_ours / 1e6:12.1f} {t_ref / t_ours:6.2f} "
              f"{t_ref / t_compiled:14.2f} {'':>11s}  {identical}")
    native_mse = nvfp4.NATIVE_MSE.load()
    print(f"\n{'mse, quantize_experts':30s} {'ours s':>8s} {'eager s':>10s} {'ours Melem/s':>12s} {'ratio':>6s} "
          f"{'compiled ratio':>14s} {'':>11s}  bit-identical")
    for label, shape in EXPERT_SHAPES.items():
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
        ours = nvfp4.quantize_experts(w, method="mse")
        t_ours = best_seconds(lambda: nvfp4.quantize_experts(w, method="mse"), args.repeats)
        nvfp4.NATIVE_MSE.function = None  # the compiled kernel
        compiled = nvfp4.quantize_experts(w, method="mse")
        t_compiled = best_seconds(lambda: nvfp4.quantize_experts(w, method="mse"), args.repeats)
        fused = nvfp4.MSE_KERNEL.compiled
        nvfp4.MSE_KERNEL.compiled = None  # the eager kernel
        ref = nvfp4.quantize_experts(w, method="mse")
        t_ref = best_seconds(lambda: nvfp4.quantize_experts(w, method="mse"), max(1, args.repeats // 3))
        nvfp4.MSE_KERNEL.compiled, nvfp4.NATIVE_MSE.function = fused, native_mse
        identical = all(torch.equal(r.weight, ref.weight)
                        and torch.equal(r.weight_scale.view(torch.uint8), ref.weight_scale.view(torch.uint8))
                        for r in (ours, compiled))
        print(f"{label:30s} {t_ours:8.4f} {t_ref:10.4f} {w.numel() / t_ours / 1e6:12.1f} {t_ref / t_ours:6.2f} "
              f"{t_ref / t_compiled:14.2f} {'':>11s}  {identical}")


if __name__ == "__main__":
    main()
