"""CPU emulation of an int8-neuron checkpoint's tensor-parallel forward.

Each rank's file is loaded through the shared layout table (``g4.exporters.neuron_int8``)
into that rank's share of transformers' own Gemma 4 modules (attention with its query
heads and KV heads, the dense MLP and the experts with their slices of the
intermediate dimension, its vocabulary slice of the lm_head). A layer then runs every
rank's share in plain torch: column outputs stay local, row-parallel partial sums are
all-reduced (summed over ranks), the lm_head slices are all-gathered along the
vocabulary. Norms and the router are replicated. The embedding lookup is done on the
host from the unscaled table and multiplied by the manifest's ``embed_scale`` (as
``Gemma4TextScaledWordEmbedding`` does in bf16), which is what the Neuron runtime must do.

int8 weights are dequantized as ``q * scale`` in fp32; NxD computes ``(x @ q.T) * scale``,
the same product in another order (aws-neuron/neuronx-distributed
``src/neuronx_distributed/quantization/quantization_layers.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from g4.convert.errors import CheckpointError
from g4.exporters.neuron_int8 import (
    EMBED_TENSOR,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    MANIFEST,
    Manifest,
    geometry,
    is_rank_index,
    layer_entries,
    layer_prefix,
    model_entries,
)


def _dequant(sd: dict[str, torch.Tensor], key: str, int8: bool, suffix: str, dtype: torch.dtype) -> torch.Tensor:
    if int8:
        return (sd[f"{key}.weight"].float() * sd[f"{key}.scale"]).to(dtype)
    return sd[f"{key}{suffix}"].to(dtype)


class NeuronEmulator(nn.Module):
    """The TP-sharded int8 model of ``out_dir`` run on the CPU.

    Args:
        out_dir: an ``int8-neuron`` output directory.
        dtype: compute dtype (fp32 by default, so the comparison with the unsharded
            model is at float tolerance).
        embed_scale: override the manifest's embedding scale (tests use it to show that
            dropping it is caught).

    Raises:
        CheckpointError: missing files, or rank files whose tensors do not fit the layout.
    """

    def __init__(self, out_dir: str | Path, *, dtype: torch.dtype = torch.float32, embed_scale: float | None = None):
        super().__init__()
        from transformers import AutoConfig
        from transformers.models.gemma4.modeling_gemma4 import (
            Gemma4RMSNorm,
            Gemma4TextDecoderLayer,
            Gemma4TextRotaryEmbedding,
        )

        out_dir = Path(out_dir)
        try:
            self.manifest = Manifest.from_dir(out_dir)
            raw_config = json.loads((out_dir / "config.json").read_text())
            ranks = [load_file(out_dir / f) for f in self.manifest.rank_files]
            self.embed_table = load_file(out_dir / self.manifest.host_embedding["file"])[EMBED_TENSOR]
        except (OSError, KeyError, json.JSONDecodeError, SafetensorError) as e:
            raise CheckpointError(f"{out_dir}: not a readable int8-neuron output ({type(e).__name__}: {e})") from e
        self.geom = g = geometry(raw_config, self.manifest.tp_degree)
        if embed_scale is None:
            self.manifest.check_embed_scale(g.arch, out_dir / MANIFEST)
        self.config = AutoConfig.from_pretrained(out_dir).get_text_config()
        self.config._attn_implementation = "sdpa"
        self.config._experts_implementation = "eager"
        self.dtype = dtype
        self.embed_scale = self.manifest.embed_scale if embed_scale is None else embed_scale
        self.rotary = Gemma4TextRotaryEmbedding(self.config)
        # layers[L][r]: rank r's share of layer L (norms and router identical on every rank).
        self.layers = nn.ModuleList()
        for L in range(g.num_layers):
            shares = nn.ModuleList()
            for r, sd in enumerate(ranks):
                with torch.device("meta"):
                    layer = Gemma4TextDecoderLayer(self.config, L)
                for e in layer_entries(has_v=g.has_v[L], quantize_attention=self.manifest.quantize_attention):
                    self._load(layer, e, sd, layer_prefix(L), r)
                heads = g.heads // g.tp
                layer.self_attn.num_key_value_groups = heads // g.kv_per_rank(L)
                shares.append(layer.eval())
            self.layers.append(shares)
        self.norm = Gemma4RMSNorm(g.hidden, eps=self.config.rms_norm_eps)
        self.norm.weight = nn.Parameter(_dequant(ranks[0], "norm", False, ".weight", dtype), requires_grad=False)
        lm = next(e for e in model_entries(tied=g.arch.tied) if e.key == "lm_head")
        self.lm_head = [_dequant(sd, "lm_head", lm.int8, lm.suffix, dtype) for sd in ranks]
        self.softcap = self.config.final_logit_softcapping

    def _load(self, layer: nn.Module, e, sd: dict, prefix: str, rank: int) -> None:
        """Entry ``e`` of rank ``rank``'s file into transformers' module at the entry's source path
        (``moe.router.proj`` in the file is ``router.proj`` in ``Gemma4TextDecoderLayer``)."""
        if is_rank_index(e):  # NxD's SPMD rank index: nothing to load into transformers' modules
            return
        key = prefix + e.key
        try:
            t = _dequant(sd, key, e.int8, e.suffix, self.dtype)
        except KeyError as err:
            raise CheckpointError(f"rank {rank} file has no tensor {err.args[0]}") from err
        fused = e.rule in (EXPERT_GATE_UP, EXPERT_DOWN)
        if fused:  # NxD [E, H, 2I/T] / [E, I/T, H] -> transformers [E, 2I/T, H] (gate_r | up_r) / [E, H, I/T]
            t = t.transpose(1, 2).contiguous()
        if e.source == e.source_module:  # a parameter/buffer path, e.g. router.scale, experts.gate_up_proj
            owner_name, _, attr = e.source_module.rpartition(".")
        else:  # a module whose .weight it is, e.g. self_attn.q_proj
            owner_name, attr = e.source_module, "weight"
        owner = layer.get_submodule(owner_name) if owner_name else layer
        if attr in owner._buffers:
            owner._buffers[attr] = t
        else:
            setattr(owner, attr, nn.Parameter(t, requires_grad=False))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Host lookup of int64 ``input_ids [B, S]`` in the unscaled bf16 table ``[V, H]``, times
        ``embed_scale`` rounded to the table dtype (as ``Gemma4TextScaledWordEmbedding``), as
        ``self.dtype``."""
        rows = self.embed_table[input_ids]
        return (rows * torch.tensor(self.embed_scale).to(rows.dtype)).to(self.dtype)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, S, V]`` (fp32 softcapped) for int64 ``input_ids`` ``[B, S]``."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        h = self.embed(input_ids)
        pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
        kw = {"config": self.config, "inputs_embeds": h, "attention_mask": None, "cache": None, "position_ids": pos}
        masks = {"full_attention": create_causal_mask(**kw), "sliding_attention": create_sliding_window_causal_mask(**kw)}
        for L, shares in enumerate(self.layers):
            t = self.config.layer_types[L]
            h = self._layer(shares, h, self.rotary(h, pos, t), masks[t], pos)
        h = self.norm(h)
        logits = torch.cat([h @ w.T for w in self.lm_head], dim=-1)  # all-gather over the vocabulary
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    @staticmethod
    def _layer(shares, h, position_embeddings, mask, pos) -> torch.Tensor:
        ref = shares[0]  # replicated parts
        residual = h
        x = ref.input_layernorm(h)
        attn = sum(s.self_attn(x, position_embeddings=position_embeddings, attention_mask=mask,
                               shared_kv_states={}, position_ids=pos)[0] for s in shares)  # all-reduce
        h = residual + ref.post_attention_layernorm(attn)
        residual = h
        x = ref.pre_feedforward_layernorm(h)
        dense = ref.post_feedforward_layernorm_1(sum(s.mlp(x) for s in shares))  # all-reduce
        flat = residual.reshape(-1, residual.shape[-1])
        _, weights, index = ref.router(flat)
        x2 = ref.pre_feedforward_layernorm_2(flat)
        moe = sum(s.experts(x2, index, weights) for s in shares).reshape(residual.shape)  # all-reduce
        h = residual + ref.post_feedforward_layernorm(dense + ref.post_feedforward_layernorm_2(moe))
        return h * ref.layer_scalar


@torch.no_grad()
def greedy(model: NeuronEmulator, input_ids: torch.Tensor, *, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding without a KV cache (full recompute each step): generated ids."""
    ids = input_ids
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(ids)[0, -1].argmax())
        out.append(nxt)
        if nxt in stop_ids:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out
