"""The quantizers' compiled kernels warmed in a background thread (g4.quantizers.compiled
CompiledKernel.warm, nvfp4.warm, int8.warm): the real calls find the compiled code, same bytes."""

from __future__ import annotations

import pytest
import torch


def test_a_warmed_kernel_is_found_by_the_real_calls_and_gives_the_same_bytes(monkeypatch):
    """nvfp4.warm / int8.warm compile in a thread on a few rows of zeros; the real calls (other
    rows, the experts' 0-d global scale views) then add no graph, and give the eager bytes."""
    from torch._dynamo.utils import counters

    from g4.quantizers import int8, nvfp4 as q

    torch._dynamo.reset()  # no compiled code of earlier tests: each width compiles here
    before = counters["stats"]["unique_graphs"]
    for kernel in (q.KERNEL, int8.KERNEL):
        monkeypatch.setattr(kernel, "min_elements", 1024)
        monkeypatch.setattr(kernel, "compiled", pipeline_unset())
    monkeypatch.setattr(q.NATIVE, "function", None)  # bf16 max: the compiled kernel, not the native one
    th = [q.warm([(96, 64, torch.bfloat16), (3, 16, torch.bfloat16), (40, 48, torch.bfloat16)]),
          int8.warm([(96, 64, torch.bfloat16)])]
    if th[0] is None:
        pytest.skip("no compiled kernel here (G4_NVFP4_EAGER set)")
    for t in th:
        t.join()
    graphs = counters["stats"]["unique_graphs"]
    if graphs == before:  # nothing compiled: a real call tells whether torch.compile works here
        q.quantize(torch.zeros(96, 64, dtype=torch.bfloat16))
        if q.KERNEL.compiled is None:
            pytest.skip("torch.compile is unavailable here (no C compiler)")
    assert graphs - before == 3  # widths 64 and 48 (3 x 16 is under min_elements), and int8's 64
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(4, 96, 64, generator=gen) * 0.02).bfloat16()
    d = (torch.randn(40, 48, generator=gen) * 0.02).bfloat16()
    got = (q.quantize_experts(w), q.quantize(d), int8.quantize(w[0]))
    assert counters["stats"]["unique_graphs"] == graphs
    monkeypatch.setattr(q.KERNEL, "compiled", None)
    monkeypatch.setattr(int8.KERNEL, "compiled", None)
    want = (q.quantize_experts(w), q.quantize(d), int8.quantize(w[0]))
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.weight_scale.view(torch.uint8),
                                                               b.weight_scale.view(torch.uint8))
    assert torch.equal(got[2].weight, want[2].weight) and torch.equal(got[2].scale, want[2].scale)


def pipeline_unset():
    """A kernel's not-yet-compiled state (CompiledKernel.compiled before the first use)."""
    from g4.quantizers import compiled

    return compiled._UNSET
