"""One token-generation step of gemma-4-26B-A4B's experts on this CPU, through NxD's ``ExpertMLPsV2``
as g4's NxD Inference class builds it, for ONE rank of TP 2, int8 expert-wise: the selective-loading
path that decode takes (``forward_selective_loading``, only the top-k experts' weights) against the
all-experts path (``forward_all_experts``), in the same run.

    python bench/bench_nxdi_decode.py [--tokens 1] [--repeats 5] [--tp 2] [--threads N]

Printed per decoder layer: milliseconds per decoded token of both paths and their ratio, the expert
FLOPs and the expert weight bytes (int8 weights, fp32 scales) each reads per decoded token, which path
``ExpertMLPsV2.forward(seq_len=1)`` dispatches to, the largest difference between the two outputs,
and both projected to the model's 30 layers.

What is built: the experts block of ``g4.serve.nxdi_gemma4`` (:func:`build_expert_mlps`, the class's
own constructor arguments, from a ``Gemma4MoEInferenceConfig`` of the release config in
``g4.convert.synth``: 128 experts, top-8, H 2816, moe_intermediate 704), in a TP-1 process group with
the expert width of one TP rank (704 / ``--tp``: the shapes rank 0 of a TP-2 run holds), ``is_prefill_stage``
off as NxDI sets it for its token-generation model, then NxD's ``convert`` to expert-wise int8 as
``convert_to_g4_int8`` does (``QuantizedExpertFused{Column,Row}Parallel``, scales ``[E, 1, out]``,
int8 ``quantized_dtype``), filled with random int8 weights and scales. Inputs: bf16 hidden states and
router affinities as ``NeuronGemma4Router`` gives them (softmax, top-k, renormalised; zero elsewhere).
Not counted: the router, the TP all-reduce of the experts' partial sums, attention, the dense MLP.

Needs the neuronx-distributed v2.28.0 and neuronx-distributed-inference 0.8 sources
(``G4_NXD_SRC`` / ``G4_NXDI_SRC``, the same defaults as ``tests/lanes/test_nxdi_gemma4.py``) and the
transformers 4.57 overlay NxDI imports with (``G4_NXDI_OVERLAY``, default ``.venv-nxdi/tf457``,
built by ``tests/lanes/test_nxdi_gemma4.py`` on first use); exits with one ``error:`` line when one is
absent. It depends on the tests' import stubs for the Neuron-only packages
(``tests/lanes/nxd_cpu/stubs.py``, ``install_nxdi``), which it imports from there.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENDOR = REPO.parent / "shared" / "vendor"
NXD_SRC = Path(os.environ.get("G4_NXD_SRC", VENDOR / "neuronx-distributed-v2.28.0" / "src"))
NXDI_SRC = Path(os.environ.get("G4_NXDI_SRC", VENDOR / "neuronx-distributed-inference-v0.8.0" / "src"))
OVERLAY = Path(os.environ.get("G4_NXDI_OVERLAY", REPO / ".venv-nxdi" / "tf457"))
MIB = 2**20


def missing() -> str | None:
    """Why the bench cannot run here, or None."""
    if not (NXD_SRC / "neuronx_distributed" / "modules" / "moe" / "expert_mlps_v2.py").is_file():
        return f"neuronx-distributed v2.28.0 source not found at {NXD_SRC} (set G4_NXD_SRC to its src/ folder)"
    if not (NXDI_SRC / "neuronx_distributed_inference" / "models" / "model_base.py").is_file():
        return (f"neuronx-distributed-inference 0.8.0 source not found at {NXDI_SRC} "
                "(set G4_NXDI_SRC to its src/ folder)")
    if not (OVERLAY / "transformers" / "__init__.py").is_file():
        return (f"transformers 4.57 overlay not found at {OVERLAY} (set G4_NXDI_OVERLAY, or run "
                "tests/lanes/test_nxdi_gemma4.py once, which builds it)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(tp: int):
    """(config, experts): the class's ExpertMLPsV2 at one rank's expert width, int8 expert-wise."""
    os.environ.setdefault("NXD_LOG_LEVEL", "warning")  # NxD's process-group set-up logs at info
    sys.path.insert(0, str(OVERLAY))  # NxDI 0.8's transformers, before anything imports transformers
    sys.path.insert(0, str(REPO / "tests" / "lanes"))
    from nxd_cpu import stubs

    stubs.install_nxdi(str(NXD_SRC), str(NXDI_SRC))
    import torch
    import torch.distributed as dist
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.quantization.quantization_config import (
        QuantizedDtype,
        get_default_expert_wise_per_channel_custom_qconfig_dict,
    )
    from neuronx_distributed.quantization.quantize import convert
    from neuronx_distributed_inference.models.config import MoENeuronConfig

    from g4.convert.synth import GEMMA4_26B_A4B
    from g4.serve.nxdi_gemma4 import Gemma4MoEInferenceConfig, build_expert_mlps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    text = dict(GEMMA4_26B_A4B["text_config"])
    if text["moe_intermediate_size"] % tp:
        raise SystemExit(f"error: moe_intermediate_size {text['moe_intermediate_size']} does not split over --tp {tp}")
    text["moe_intermediate_size"] //= tp  # the expert width one rank holds
    neuron_config = MoENeuronConfig(tp_degree=1, batch_size=1, seq_len=128, torch_dtype=torch.bfloat16, on_cpu=True)
    neuron_config.is_prefill_stage = False  # NxDI's token-generation model (models/model_base.py)
    config = Gemma4MoEInferenceConfig(neuron_config, **text)
    experts = build_expert_mlps(config)
    # as g4.serve.nxdi_gemma4.convert_to_g4_int8 converts the experts (int8, not NxD's float8 default)
    qconfig = get_default_expert_wise_per_channel_custom_qconfig_dict()
    qconfig["quantized_dtype"] = QuantizedDtype.INT8
    convert(experts, q_config=qconfig, inplace=True, mapping=None)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in experts.state_dict().items():
            if t.dtype == torch.int8:
                t.copy_(torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8))
            elif t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=gen) * 1e-3 + 1e-4)
    experts.eval()
    return config, experts


def expert_tensors(experts) -> dict[str, tuple[int, int]]:
    """``{state-dict name: (bytes per expert, elements of the weight per expert)}`` of the experts'
    int8 weights and fp32 scales (every tensor with a leading expert dimension)."""
    E = experts.routed_experts_mlp_config.num_experts
    out = {}
    for name, t in experts.state_dict().items():
        if t.dim() >= 2 and t.shape[0] == E:
            out[name] = (t.numel() * t.element_size() // E, t.numel() // E)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1, help="decode tokens per step (batch); 1 to 15 stay selective")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per path (median reported)")
    ap.add_argument("--tp", type=int, default=2, help="TP degree whose rank-0 expert width is built")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.tokens < 1 or args.repeats < 1 or args.tp < 1:
        raise SystemExit("error: --tokens, --repeats and --tp must be >= 1")
    why = missing()
    if why:
        raise SystemExit(f"error: {why}")
    t0 = time.perf_counter()
    config, experts = build(args.tp)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = experts.routed_experts_mlp_config
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    T = args.tokens
    gen = torch.Generator().manual_seed(1)
    hidden = (torch.randn(T, H, generator=gen) * 0.5).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(T, E, generator=gen), dim=-1)
    weights, index = torch.topk(probs, K, dim=-1)
    affinities = torch.zeros(T, E).scatter(1, index, weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)

    picked = []
    for name in ("forward_selective_loading", "forward_all_experts", "forward_blockwise", "forward_capacity_factor"):
        orig = getattr(experts, name)
        setattr(experts, name, lambda *a, _o=orig, _n=name, **k: (picked.append(_n), _o(*a, **k))[1])

    def timed(fn) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            out = fn()  # warm-up (first-call allocation)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3, out

    with torch.no_grad():
        experts(hidden, affinities, index, seq_len=1)
    dispatched = picked[0]
    ms_sel, out_sel = timed(lambda: experts.forward_selective_loading(hidden, affinities, index))
    ms_all, out_all = timed(lambda: experts.forward_all_experts(hidden, affinities, index))
    diff = (out_sel.float() - out_all.float()).abs().max().item()
    scale = out_all.float().abs().max().item()

    per_expert = expert_tensors(experts)
    w_bytes = sum(b for n, (b, _) in per_expert.items() if n.endswith(".weight"))
    s_bytes = sum(b for n, (b, _) in per_expert.items() if n.endswith(".scale"))
    macs = sum(e for n, (_, e) in per_expert.items() if n.endswith(".weight"))  # one multiply-add per weight
    # (ms, experts' weights read per step, experts computed per step): selective loading gathers each
    # token's top-k experts (a token loop, expert_mlps_v2.py forward_selective_loading); the all-experts
    # path reads every expert once per step and computes every token through every expert
    rows = {
        "selective (decode)": (ms_sel, T * K, T * K),
        "all experts": (ms_all, E, T * E),
    }
    layers = config.num_hidden_layers
    print(f"gemma-4-26B-A4B experts, one rank of TP {args.tp}: E={E}, top-{K}, H={H}, I/TP={I} (I={I * args.tp}); "
          f"int8 expert-wise, bf16 activations; {T} decode token(s) per step; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats}")
    print(f"ExpertMLPsV2.forward(seq_len=1) dispatches to: {dispatched}")
    print(f"{'path':<20} {'ms/token/layer':>15} {'expert GFLOP/token':>19} {'weights MiB/token':>18} "
          f"{'scales MiB/token':>17} {'ms/token, ' + str(layers) + ' layers':>22}")
    for name, (ms, loaded, computed) in rows.items():
        flops = 2 * macs * computed / T  # per decoded token: each token's experts (all of them on the all path)
        read = loaded / T  # experts' bytes read per decoded token
        print(f"{name:<20} {ms / T:>15.1f} {flops / 1e9:>19.3f} {read * w_bytes / MIB:>18.2f} "
              f"{read * s_bytes / MIB:>17.3f} {ms / T * layers:>22.0f}")
    print(f"all experts / selective: {ms_all / ms_sel:.1f}x time, {E / (T * K):.1f}x weight bytes, "
          f"{E / K:.0f}x FLOPs; max |selective - all| = {diff:.2e} (outputs up to {scale:.2e})")
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
