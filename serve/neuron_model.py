"""The Neuron module tree of an int8-neuron result: one SPMD (per TP rank) Gemma 4 MoE
text model whose ``state_dict()`` names, per-rank shapes and dtypes are exactly the rank
files' (``g4.exporters.neuron_int8``), written once and built from either of two layer sets:

- :class:`CpuParallelOps`: plain-torch parallel linears that hold one rank's share and do
  their collectives through a :class:`Comm` (a single process, or ``torch.distributed``
  with the gloo backend, one process per rank: :func:`run_spmd`). This is how the module
  tree is tested on any machine.
- ``g4.serve.neuron_runtime.NxdParallelOps``: neuronx-distributed's
  ``QuantizedColumnParallel`` / ``QuantizedRowParallel`` /
  ``QuantizedExpertFusedColumnParallel`` / ``QuantizedExpertFusedRowParallel`` (and the
  unquantized ``ColumnParallelLinear`` / ``RowParallelLinear`` for bf16 attention), which
  do the same collectives on NeuronCores.

Both layer sets follow NxD's forward (aws-neuron/neuronx-distributed
``src/neuronx_distributed/quantization/quantization_layers.py``):
``y = (x @ q.T) * scale.T`` with the scale applied in fp32 after the matmul; column layers
keep their output slice (or all-gather it along the last dim with ``gather_output``), row
layers all-reduce; expert layers take ``x`` as ``[E, N, in]`` and return ``[E, N, out]``
per expert (einsum ``e n h, e h i -> e n i``), the down projection without a reduce: the
all-reduce follows the MoE combine.

Graph shape: the forward is one full-sequence pass without a KV cache
(``inputs_embeds [B, S, H]`` and ``position_ids [B, S]`` -> logits ``[B, S, V]``), and it
computes every expert for every token and weights the outputs with the router's
(renormalised, ``per_expert_scale``-multiplied) top-k weights, zero for the experts a token
did not choose. That is exact and shape-static (what a Neuron trace needs) at the cost of
``E / top_k`` times the expert FLOPs of a gather-based MoE.

The embedding lookup is not in the tree: the host multiplies the unscaled table rows by
the manifest's ``embed_scale`` (bf16(sqrt(H)) = 53.0 for H = 2816; P12) and passes
``inputs_embeds``.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from g4.convert.gemma4 import LAYER_NORMS
from g4.exporters.neuron_int8 import EMBED_TENSOR, MANIFEST, Geometry, Manifest, geometry


class Comm(Protocol):
    """Collectives over the TP group of one rank."""

    rank: int
    world: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor: ...


class SingleRank:
    """The TP=1 group: collectives are identities."""

    rank, world = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TorchDistComm:
    """Collectives of the default ``torch.distributed`` process group (gloo on CPU)."""

    def __init__(self):
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        y = x.contiguous().clone()
        self._dist.all_reduce(y)
        return y

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def _params(module: nn.Module, shape: tuple[int, ...], int8: bool, dtype: torch.dtype, scale_shape: tuple[int, ...]):
    module.weight = nn.Parameter(torch.empty(shape, dtype=torch.int8 if int8 else dtype), requires_grad=False)
    if int8:
        module.scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)


def _matmul_dequant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T`` with int8 weights cast exactly and the per-channel scale applied after, in fp32."""
    y = F.linear(x, weight.to(x.dtype))
    if scale is None:
        return y
    return (y.float() * scale.T).to(x.dtype)


class RankColumnLinear(nn.Module):
    """One rank's share of a column-parallel linear: ``weight [out/T, in]`` (int8 with fp32
    ``scale [out/T, 1]``, or ``dtype``); output ``[..., out/T]``, or ``[..., out]`` all-gathered."""

    def __init__(self, in_features: int, out_local: int, *, int8: bool, dtype: torch.dtype, comm: Comm,
                 gather_output: bool = False):
        super().__init__()
        _params(self, (out_local, in_features), int8, dtype, (out_local, 1))
        self.int8, self.comm, self.gather_output = int8, comm, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul_dequant(x, self.weight, self.scale if self.int8 else None)
        return self.comm.all_gather_last(y) if self.gather_output else y


class RankRowLinear(nn.Module):
    """One rank's share of a row-parallel linear: ``weight [out, in/T]``, replicated fp32
    ``scale [out, 1]``; input ``[..., in/T]``, output ``[..., out]`` all-reduced."""

    def __init__(self, in_local: int, out_features: int, *, int8: bool, dtype: torch.dtype, comm: Comm):
        super().__init__()
        _params(self, (out_features, in_local), int8, dtype, (out_features, 1))
        self.int8, self.comm = int8, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(_matmul_dequant(x, self.weight, self.scale if self.int8 else None))


class RankExpertLinear(nn.Module):
    """One rank's share of a fused expert linear in NxD's layout: int8 ``weight [E, in, out]``
    (in or out split by T), expert-wise fp32 ``scale [E, 1, out]``; input ``[E, 1, N, in]``,
    output ``[E, 1, N, out]`` (no collective), as NxD's quantized expert layers take them."""

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__()
        _params(self, (experts, in_features, out_features), True, torch.int8, (experts, 1, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("ekni,eio->ekno", x, self.weight.to(x.dtype))
        return (y.float() * self.scale.unsqueeze(1)).to(x.dtype)


class RankIndex(nn.Module):
    """This rank's index as NxD's ``SPMDRank`` holds it: ``rank`` int32 ``[1]`` (state only)."""

    def __init__(self):
        super().__init__()
        self.rank = nn.Parameter(torch.empty(1, dtype=torch.int32), requires_grad=False)


class RankEmbedding(nn.Module):
    """This rank's column shard ``weight [V, H/T]`` of the device embedding that g4's NxDI class
    holds (NxD ``ParallelEmbedding(shard_across_embedding=True)``). State only: this tree takes
    ``inputs_embeds`` looked up on the host (:func:`host_embed`)."""

    def __init__(self, vocab: int, hidden_local: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden_local, dtype=dtype), requires_grad=False)


class CpuParallelOps:
    """Builds the parallel layers of TP rank ``comm.rank`` of ``comm.world`` in plain torch."""

    def __init__(self, comm: Comm, dtype: torch.dtype = torch.bfloat16):
        self.comm, self.dtype = comm, dtype
        self.tp = comm.world

    def column(self, in_features: int, out_features: int, *, int8: bool, gather_output: bool = False) -> nn.Module:
        return RankColumnLinear(in_features, out_features // self.tp, int8=int8, dtype=self.dtype, comm=self.comm,
                                gather_output=gather_output)

    def row(self, in_features: int, out_features: int, *, int8: bool) -> nn.Module:
        return RankRowLinear(in_features // self.tp, out_features, int8=int8, dtype=self.dtype, comm=self.comm)

    def expert_gate_up(self, experts: int, hidden: int, intermediate: int) -> nn.Module:
        return RankExpertLinear(experts, hidden, 2 * intermediate // self.tp)

    def expert_down(self, experts: int, intermediate: int, hidden: int) -> nn.Module:
        return RankExpertLinear(experts, intermediate // self.tp, hidden)

    def rank_index(self) -> nn.Module:
        return RankIndex()

    def embedding(self, vocab: int, hidden: int) -> nn.Module:
        return RankEmbedding(vocab, hidden // self.tp, self.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x)


class _Attention(nn.Module):
    def __init__(self, config, g: Geometry, layer: int, ops, quantize_attention: bool):
        super().__init__()
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        hd, T = g.head_dim[layer], g.tp
        self.head_dim, self.heads_local, self.kv_local = hd, g.heads // T, g.kv_per_rank(layer)
        kv_total = self.kv_local * hd * T  # whole KV heads replicated when there are fewer than ranks
        self.q_proj = ops.column(g.hidden, g.heads * hd, int8=quantize_attention)
        self.k_proj = ops.column(g.hidden, kv_total, int8=quantize_attention)
        self.v_proj = ops.column(g.hidden, kv_total, int8=quantize_attention) if g.has_v[layer] else None
        self.o_proj = ops.row(g.heads * hd, g.hidden, int8=quantize_attention)
        self.q_norm = Gemma4RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(hd, eps=config.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(hd, eps=config.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.heads_local, self.head_dim))
        k = self.k_proj(x).view(B, S, self.kv_local, self.head_dim)
        v = self.v_proj(x).view(B, S, self.kv_local, self.head_dim) if self.v_proj is not None else k  # k_eq_v
        q = apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim=2).transpose(1, 2)
        k = apply_rotary_pos_emb(self.k_norm(k), cos, sin, unsqueeze_dim=2).transpose(1, 2)
        v = self.v_norm(v).transpose(1, 2)
        rep = self.heads_local // self.kv_local
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)  # Gemma 4: scaling 1.0
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.heads_local * self.head_dim))


class _Mlp(nn.Module):
    def __init__(self, g: Geometry, ops, act):
        super().__init__()
        self.gate_proj = ops.column(g.hidden, g.intermediate, int8=True)
        self.up_proj = ops.column(g.hidden, g.intermediate, int8=True)
        self.down_proj = ops.row(g.intermediate, g.hidden, int8=True)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Router(nn.Module):
    """Gemma 4's router, replicated: RMS norm without weight, ``* scale * H**-0.5``, a bf16
    linear, fp32 softmax, top-k renormalised, ``* per_expert_scale``. Returns the dense
    ``[N, E]`` combine weights (zero where not chosen)."""

    def __init__(self, config, g: Geometry, dtype: torch.dtype):
        super().__init__()
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        self.norm = Gemma4RMSNorm(g.hidden, eps=config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(g.hidden, g.experts, bias=False, dtype=dtype)
        self.scale = nn.Parameter(torch.empty(g.hidden, dtype=dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(g.experts, dtype=dtype), requires_grad=False)
        self.top_k, self.root = config.top_k_experts, g.hidden ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) * self.scale.to(x.dtype) * self.root
        probs = F.softmax(F.linear(h, self.proj.weight.to(x.dtype)), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * self.per_expert_scale.to(torch.float32)[idx]
        return torch.zeros_like(probs).scatter(-1, idx, w)


class _Experts(nn.Module):
    def __init__(self, g: Geometry, ops, act):
        super().__init__()
        self.gate_up_proj = ops.expert_gate_up(g.experts, g.hidden, g.moe_intermediate)
        self.down_proj = ops.expert_down(g.experts, g.moe_intermediate, g.hidden)
        self.act, self.experts = act, g.experts

    def forward(self, x: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        """``x [N, H]``, ``combine [N, E]`` fp32 -> this rank's partial ``[N, H]`` (before the all-reduce)."""
        # NxD's quantized expert layers take [E, 1, N, in] (aws-neuron/neuronx-distributed
        # src/neuronx_distributed/modules/moe/experts.py: Experts.forward views its input so):
        # a 3-D input fails in quantization/dequantize.py, whose expert-wise scale [E, 1, out]
        # is unsqueezed to [E, 1, 1, out].
        tokens = x.reshape(1, 1, *x.shape).expand(self.experts, -1, -1, -1)  # a view: no copy per expert
        gate, up = self.gate_up_proj(tokens).chunk(2, dim=-1)  # [gate_r | up_r]
        y = self.down_proj(self.act(gate) * up).squeeze(1)  # [E, N, H]
        return torch.einsum("enh,ne->nh", y.float(), combine).to(x.dtype)


class _ExpertMlps(nn.Module):
    """Named as NxD's ``ExpertMLPsV2``: the fused expert linears under ``mlp_op``, the rank index
    under ``spmd_rank``."""

    def __init__(self, g: Geometry, ops, act):
        super().__init__()
        self.mlp_op = _Experts(g, ops, act)
        self.spmd_rank = ops.rank_index()


class _Moe(nn.Module):
    """``moe.router`` and ``moe.expert_mlps``: the names of g4's NxDI class (the layout table's)."""

    def __init__(self, config, g: Geometry, ops, act, dtype: torch.dtype):
        super().__init__()
        self.router = _Router(config, g, dtype)
        self.expert_mlps = _ExpertMlps(g, ops, act)


class NeuronDecoderLayer(nn.Module):
    """One Gemma 4 MoE decoder layer's rank share; submodule names are the layout table's keys."""

    def __init__(self, config, g: Geometry, layer: int, ops, *, quantize_attention: bool, dtype: torch.dtype):
        super().__init__()
        from transformers.activations import ACT2FN
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        act = ACT2FN[config.hidden_activation]
        self.self_attn = _Attention(config, g, layer, ops, quantize_attention)
        self.mlp = _Mlp(g, ops, act)
        self.moe = _Moe(config, g, ops, act, dtype)
        for n in LAYER_NORMS:
            setattr(self, n, Gemma4RMSNorm(g.hidden, eps=config.rms_norm_eps))
        self.layer_scalar = nn.Parameter(torch.empty(1, dtype=dtype), requires_grad=False)
        self.all_reduce = ops.all_reduce

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        residual = h
        h = residual + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, mask))
        residual = h
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        flat = residual.reshape(-1, residual.shape[-1])
        experts = self.moe.expert_mlps.mlp_op
        moe = self.all_reduce(experts(self.pre_feedforward_layernorm_2(flat), self.moe.router(flat)))
        h = residual + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(
            moe.reshape(residual.shape)))
        return h * self.layer_scalar.to(h.dtype)


class NeuronTextModel(nn.Module):
    """The per-rank Gemma 4 MoE text model traced for Neuron (and run on CPU by :func:`run_spmd`).

    Args:
        config: the result's ``config.json`` as a dict (multimodal or text form).
        ops: :class:`CpuParallelOps` or ``g4.serve.neuron_runtime.NxdParallelOps``; its
            ``tp`` is the TP degree.
        quantize_attention: the result was converted with ``--quantize-attention``.
        dtype: dtype of the non-int8 parameters and of the activations (bf16 on Neuron).

    ``forward(inputs_embeds [B, S, H] (already multiplied by embed_scale),
    position_ids int64 [B, S]) -> logits fp32 [B, S, V]`` (final soft-capping applied).

    Raises:
        G4Error: a config that is not a Gemma 4 MoE, or a TP degree it cannot be split over.
    """

    def __init__(self, config: dict, ops, *, quantize_attention: bool = False, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        from transformers import AutoConfig
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextRotaryEmbedding

        self.geom = g = geometry(config, ops.tp)
        rest = {k: v for k, v in config.items() if k != "model_type"}
        text = AutoConfig.for_model(config["model_type"], **rest).get_text_config()
        self.text_config = text
        self.rank_util = ops.rank_index()
        self.embed_tokens = ops.embedding(g.vocab, g.hidden)  # state only: inputs_embeds come from the host
        self.layers = nn.ModuleList(NeuronDecoderLayer(text, g, L, ops, quantize_attention=quantize_attention,
                                                       dtype=dtype) for L in range(g.num_layers))
        self.norm = Gemma4RMSNorm(g.hidden, eps=text.rms_norm_eps)
        for m in self.modules():  # norm weights are stored (and traced) in the model dtype, not fp32
            if isinstance(m, Gemma4RMSNorm):
                m.to(dtype)
        self.lm_head = ops.column(g.hidden, g.vocab, int8=True, gather_output=True)
        with torch.device("cpu"):
            self.rotary = Gemma4TextRotaryEmbedding(text)
        self.softcap = text.final_logit_softcapping
        self.sliding_window = text.sliding_window

    def _mask(self, S: int, sliding: bool, device) -> torch.Tensor:
        i = torch.arange(S, device=device)
        allowed = i[None, :] <= i[:, None]
        if sliding:
            allowed &= (i[:, None] - i[None, :]) < self.sliding_window
        return allowed

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = inputs_embeds
        S = h.shape[1]
        masks = {t: self._mask(S, t == "sliding_attention", h.device) for t in set(self.geom.layer_types)}
        rope = {t: self.rotary(h, position_ids, t) for t in masks}
        for L, layer in enumerate(self.layers):
            t = self.geom.layer_types[L]
            h = layer(h, *rope[t], masks[t])
        logits = self.lm_head(self.norm(h)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def host_embed(table: torch.Tensor, input_ids: torch.Tensor, embed_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Host lookup of int64 ``input_ids [B, S]`` in the unscaled bf16 ``table [V, H]``, times
    ``embed_scale`` rounded to the table dtype (as ``Gemma4TextScaledWordEmbedding``), as ``dtype``."""
    rows = table[input_ids]
    return (rows * torch.tensor(embed_scale).to(rows.dtype)).to(dtype)


def load_rank_model(out_dir: str | Path, comm: Comm, *, dtype: torch.dtype = torch.float32) -> NeuronTextModel:
    """Rank ``comm.rank``'s module tree with that rank's file loaded by exact state-dict names
    (``load_state_dict(strict=True, assign=True)``: every key present, none extra, dtypes kept).

    ``dtype``: the non-int8 parameters are cast to it after loading (fp32 on CPU for a
    float-tolerance comparison).

    Raises:
        CheckpointError: rank files that differ from the layout table (see
            ``g4.serve.neuron_runtime.load_rank_weights``).
    """
    import json

    from g4.serve.neuron_runtime import load_rank_weights

    out_dir = Path(out_dir)
    manifest = Manifest.from_dir(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    sd = load_rank_weights(out_dir, ranks=[comm.rank])[0]
    with torch.device("meta"):
        model = NeuronTextModel(config, CpuParallelOps(comm), dtype=torch.bfloat16,
                                quantize_attention=manifest.quantize_attention)
    model.load_state_dict(sd, strict=True, assign=True)
    for p in model.parameters():
        if p.dtype.is_floating_point and p.dtype != torch.float32:
            p.data = p.data.to(dtype)
    model.rotary = type(model.rotary)(model.text_config)  # rebuild the non-persistent RoPE buffers off meta
    return model.eval()


def _spmd_worker(rank: int, world: int, port: int, out_dir: str, ids_path: str, result_path: str) -> None:
    import json

    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        comm = TorchDistComm()
        model = load_rank_model(out_dir, comm)
        manifest = Manifest.from_dir(out_dir)
        table = load_file(Path(out_dir) / manifest.host_embedding["file"])[EMBED_TENSOR]
        manifest.check_embed_scale(model.geom.arch, Path(out_dir) / MANIFEST)
        ids = load_file(ids_path)["input_ids"]
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            logits = model(host_embed(table, ids, manifest.embed_scale, torch.float32), pos)
        if rank == 0:
            save_file({"logits": logits.contiguous()}, result_path)
        # every rank leaves together: a rank that tears gloo down while its peer still holds the
        # connection can abort the peer ("terminate called without an active exception", SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_spmd(out_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Run the module tree of every TP rank of ``out_dir`` as its own process
    (``torch.distributed``, gloo, loopback) on int64 ``input_ids [B, S]``; rank 0's
    logits ``[B, S, V]`` fp32 (every rank holds the same after the lm_head all-gather).

    Raises:
        RuntimeError: a rank process failed (its traceback is printed by torch).
    """
    import json

    import torch.multiprocessing as mp
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    world = Manifest.from_dir(out_dir).tp_degree
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="g4-spmd-") as tmp:
        ids_path, result_path = os.path.join(tmp, "ids.safetensors"), os.path.join(tmp, "logits.safetensors")
        save_file({"input_ids": input_ids.contiguous()}, ids_path)
        mp.spawn(_spmd_worker, args=(world, port, str(out_dir), ids_path, result_path), nprocs=world, join=True)
        return load_file(result_path)["logits"]

