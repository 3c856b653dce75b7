"""CPU emulation of an int8-neuron checkpoint's tensor-parallel forward.

Each rank's tensors of a decoder layer are loaded through the shared layout table
(``g4.exporters.neuron_int8``) into that rank's share of transformers' own Gemma 4 modules
(attention with its query heads and KV heads, the dense MLP and the experts with their slices
of the intermediate dimension), and the vocabulary slice of the lm_head is that rank's. A layer
then runs every rank's share in plain torch: column outputs stay local, row-parallel partial
sums are all-reduced (summed over ranks), the lm_head slices are all-gathered along the
vocabulary. Norms and the router are replicated. The embedding lookup is done on the host from
the unscaled table and multiplied by the manifest's ``embed_scale`` (as
``Gemma4TextScaledWordEmbedding`` does in bf16), which is what the Neuron runtime must do.

int8 weights are dequantized as ``q * scale`` in fp32
(:func:`g4.exporters.neuron_int8.dequantized_local`); NxD computes ``(x @ q.T) * scale``, the
same product in another order (aws-neuron/neuronx-distributed
``src/neuronx_distributed/quantization/quantization_layers.py``).

Memory: the weights stay as the rank files store them (int8 with fp32 scales, bf16 norms and
router) and are dequantized on use, one layer at a time: the attention and dense MLP of a layer
when the layer runs, each expert only when the router sends a token to it (transformers' eager
experts index ``gate_up_proj[expert]``, which :class:`_ExpertWeights` dequantizes), each rank's
lm_head slice when the logits are computed; none of it is kept after the forward. With
``stream=False`` the rank files' tensors are read once and held in RAM (about the files' size,
less the device embedding shards the emulator does not use); with ``stream=True`` each forward
reads every layer's tensors from the files again (plain reads, no memory map) and drops them
after the layer, so RAM holds one layer of every rank (int8) beside the dequantized non-expert
weights of that layer, or in the head phase one rank's lm_head slice dequantized beside its int8.
The host embedding table is read row by row (only the rows of the tokens used). Both give the
same logits bit for bit, and the same as this emulator gave when it held every layer in fp32
(dequantizing a slice is the slice of the dequantized tensor). ``g4.serve.engine.load_cpu_engine``
picks ``stream`` by the memory this host has (``g4.serve.engine.whole_model_fits``, with
:func:`whole_model_bytes`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from g4.core.checkpoint import read_safetensors_header
from g4.core.errors import CheckpointError
from g4.core.positions import PositionBuilder
from g4.exporters.neuron_int8 import (
    DEVICE_EMBEDDING,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    Entry,
    Geometry,
    Manifest,
    check_rank_files,
    dequantized_local,
    geometry,
    host_rows,
    is_rank_index,
    layer_entries,
    layer_prefix,
    model_entries,
)


def read_rank_tensors(headers: list[dict], names: list[str]) -> list[dict[str, torch.Tensor]]:
    """Per rank file, the tensors named ``names`` (every file holds them all), read into RAM as
    stored, with plain file reads into each tensor's own memory, not through a memory map (the
    pages of a mapped file would stay in this process's resident set while it is open).

    Args:
        headers: per rank file, its header (:func:`g4.core.checkpoint.read_safetensors_header`:
            name -> dtype, shape, path, data offset).

    Raises:
        CheckpointError: a file cannot be read, or ends before a tensor's data.
    """
    ranks = []
    for header in headers:
        path = header[names[0]].path
        try:
            with open(path, "rb") as f:
                out = {}
                for n in names:
                    info = header[n]
                    t = torch.empty(info.shape, dtype=info.dtype)
                    f.seek(info.offset)
                    if f.readinto(t.reshape(-1).view(torch.uint8).numpy()) != info.nbytes:
                        raise OSError(f"tensor {n} ends past the end of the file")
                    out[n] = t
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable rank file ({type(e).__name__}: {e})") from e
        ranks.append(out)
    return ranks


def _kept_entries(entries: list[Entry]) -> list[Entry]:
    """The entries the emulator reads: not the SPMD rank indices nor the device embedding shard
    (the host table is read instead)."""
    return [e for e in entries if not is_rank_index(e) and e is not DEVICE_EMBEDDING]


def _layer_entries(g: Geometry, manifest: Manifest) -> list[list[Entry]]:
    """Per decoder layer, the entries the emulator reads."""
    return [_kept_entries(layer_entries(has_v=g.has_v[L], quantize_attention=manifest.quantize_attention))
            for L in range(g.num_layers)]


def _read_names(g: Geometry, manifest: Manifest) -> list[str]:
    """Every rank-file tensor the emulator reads: the decoder layers', the final norm and the lm_head."""
    model = {e.key: e for e in model_entries(tied=g.arch.tied)}
    names = [n for L, entries in enumerate(_layer_entries(g, manifest)) for e in entries for n in e.names(layer_prefix(L))]
    return names + model["norm"].names("") + model["lm_head"].names("")


def whole_model_bytes(out_dir: str | Path, dtype: torch.dtype = torch.float32) -> int:
    """Bytes :class:`NeuronEmulator` holds with ``stream=False`` on the result in ``out_dir``, from
    the rank files' headers alone: every rank file's tensors the emulator reads, as stored (int8
    weights, fp32 scales, bf16 norms and router; not the device embedding shards nor the rank
    indices), plus the largest thing dequantized on top of them, one rank's lm_head slice
    ``[V/T, H]`` in ``dtype``.

    Raises:
        CheckpointError: the result differs from the layout table
            (:func:`g4.exporters.neuron_int8.check_rank_files`).
    """
    manifest, config, paths = check_rank_files(out_dir)
    g = geometry(config, manifest.tp_degree)
    names = _read_names(g, manifest)
    headers = [read_safetensors_header(p) for p in paths]
    held = sum(h[n].nbytes for h in headers for n in names)
    lm_head = next(e for e in model_entries(tied=g.arch.tied) if e.key == "lm_head")
    head = headers[0][lm_head.names("")[0]]
    return held + head.nbytes // head.dtype.itemsize * dtype.itemsize


class _ExpertWeights:
    """One rank's share of a layer's fused experts as the rank file stores it (NxD layout:
    int8 ``[E, H, 2I/T]`` gate_up / ``[E, I/T, H]`` down with fp32 expert-wise scales), indexed
    as transformers' eager ``Gemma4TextExperts.forward`` indexes its parameter
    (``self.gate_up_proj[expert_idx]``): ``[expert]`` is that expert's weight dequantized to
    ``dtype`` in the Hugging Face layout (``[2I/T, H]`` gate_r | up_r, ``[H, I/T]`` down),
    contiguous: bit for bit the expert's slice of the whole tensor dequantized and transposed.
    Only the experts the router picks are ever dequantized, one at a time."""

    def __init__(self, e: Entry, tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype):
        self.entry, self.prefix, self.dtype = e, prefix, dtype
        self.names = e.names(prefix)
        self.tensors = {n: tensors[n] for n in self.names}

    def __getitem__(self, expert) -> torch.Tensor:
        i = int(expert)
        one = {n: t[i] for n, t in self.tensors.items()}  # [H, 2I/T] + [1, 2I/T], or [I/T, H] + [1, H]
        return dequantized_local(self.entry, one, self.prefix, self.dtype, transpose=True)


class NeuronEmulator(nn.Module):
    """The TP-sharded int8 model of ``out_dir`` run on the CPU.

    Args:
        out_dir: an ``int8-neuron`` output directory.
        dtype: compute dtype (fp32 by default, so the comparison with the unsharded
            model is at float tolerance).
        embed_scale: use this embedding scale instead of the manifest's (tests use it to show
            that dropping it is caught; the manifest's is still checked).
        stream: read each layer's tensors from the rank files on every forward instead of
            holding the files' tensors in RAM (see the module docstring; same logits).

    Raises:
        CheckpointError: missing files, or rank files whose tensors do not fit the layout
            (:func:`g4.exporters.neuron_int8.check_rank_files`, headers only), or an unreadable
            rank file.
    """

    def __init__(self, out_dir: str | Path, *, dtype: torch.dtype = torch.float32, embed_scale: float | None = None,
                 stream: bool = False):
        super().__init__()
        from transformers import AutoConfig
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        self.out_dir = out_dir = Path(out_dir)
        self.manifest, raw_config, paths = check_rank_files(out_dir)
        self._headers = [read_safetensors_header(p) for p in paths]
        self.geom = g = geometry(raw_config, self.manifest.tp_degree)
        self.config = AutoConfig.from_pretrained(out_dir).get_text_config()
        self.config._attn_implementation = "sdpa"
        self.config._experts_implementation = "eager"
        self.dtype = dtype
        self.stream = stream
        self.embed_scale = self.manifest.embed_scale if embed_scale is None else embed_scale
        self.positions = PositionBuilder(self.config)
        self._entries = _layer_entries(g, self.manifest)
        model = {e.key: e for e in model_entries(tied=g.arch.tied)}
        self._lm_head = model["lm_head"]
        # stream=False: every rank file's tensors, as stored; stream=True: read again on every use.
        self._held = None if stream else read_rank_tensors(self._headers, _read_names(g, self.manifest))
        self.norm = Gemma4RMSNorm(g.hidden, eps=self.config.rms_norm_eps)
        norm_weight = dequantized_local(model["norm"], self._tensors(model["norm"].names(""), [0])[0], "", dtype)
        self.norm.weight = nn.Parameter(norm_weight, requires_grad=False)
        self.softcap = self.config.final_logit_softcapping

    def _tensors(self, names: list[str], ranks: list[int] | None = None) -> list[dict[str, torch.Tensor]]:
        """Tensors ``names`` of each rank in ``ranks`` (default all), as the rank files store them."""
        ranks = range(self.geom.tp) if ranks is None else ranks
        if self._held is not None:
            return [{n: self._held[r][n] for n in names} for r in ranks]
        return read_rank_tensors([self._headers[r] for r in ranks], names)

    def shares(self, layer: int) -> list[nn.Module]:
        """Every rank's share of decoder layer ``layer`` (transformers' ``Gemma4TextDecoderLayer``,
        eval mode): weights other than the experts dequantized to ``dtype`` now, the experts kept
        as stored and dequantized per expert on use (:class:`_ExpertWeights`)."""
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

        g, prefix = self.geom, layer_prefix(layer)
        entries = self._entries[layer]
        out = []
        for sd in self._tensors([n for e in entries for n in e.names(prefix)]):
            with torch.device("meta"):
                module = Gemma4TextDecoderLayer(self.config, layer)
            for e in entries:
                self._load(module, e, sd, prefix)
            module.self_attn.num_key_value_groups = g.heads // g.tp // g.kv_per_rank(layer)
            out.append(module.eval())
        return out

    def _load(self, layer: nn.Module, e: Entry, sd: dict, prefix: str) -> None:
        """Entry ``e`` of one rank's tensors into transformers' module at the entry's source path
        (``moe.router.proj`` in the file is ``router.proj`` in ``Gemma4TextDecoderLayer``)."""
        if e.source == e.source_module:  # a parameter/buffer path, e.g. router.scale, experts.gate_up_proj
            owner_name, _, attr = e.source_module.rpartition(".")
        else:  # a module whose .weight it is, e.g. self_attn.q_proj
            owner_name, attr = e.source_module, "weight"
        owner = layer.get_submodule(owner_name) if owner_name else layer
        if e.rule in (EXPERT_GATE_UP, EXPERT_DOWN):  # NxD [E, H, 2I/T] / [E, I/T, H], indexed per expert
            delattr(owner, attr)  # the meta parameter; transformers' forward only indexes it
            setattr(owner, attr, _ExpertWeights(e, sd, prefix, self.dtype))
            return
        t = dequantized_local(e, sd, prefix, self.dtype)
        if attr in owner._buffers:
            owner._buffers[attr] = t
        else:
            setattr(owner, attr, nn.Parameter(t, requires_grad=False))

    def head_weight(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s lm_head slice ``[V/T, H]`` dequantized to ``dtype``."""
        names = self._lm_head.names("")
        return dequantized_local(self._lm_head, self._tensors(names, [rank])[0], "", self.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Host lookup of int64 ``input_ids [B, S]`` in the unscaled bf16 table ``[V, H]``, times
        ``embed_scale`` rounded to the table dtype (as ``Gemma4TextScaledWordEmbedding``), as
        ``self.dtype``."""
        rows = host_rows(self.out_dir, self.manifest.host_embedding, input_ids)
        return (rows * torch.tensor(self.embed_scale).to(rows.dtype)).to(self.dtype)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, S, V]`` (fp32 softcapped) for int64 ``input_ids`` ``[B, S]``."""
        h = self.embed(input_ids)
        pos = self.positions.positions(h)
        for L in range(self.geom.num_layers):
            t = self.config.layer_types[L]
            shares = self.shares(L)
            h = self._layer(shares, h, pos.rope[t], pos.masks[t], pos.ids)
            del shares  # before the next layer is read
        h = self.norm(h)
        logits = torch.cat([h @ self.head_weight(r).T for r in range(self.geom.tp)], dim=-1)  # all-gather over V
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
