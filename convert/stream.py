"""Gemma 4 language models run one decoder layer at a time, straight from a checkpoint.

The CPU reference for checkpoints larger than RAM (``g4convert verify`` of the 26B): no
whole model is ever built. Each decoder layer is transformers' own
``Gemma4TextDecoderLayer``, built on the meta device and given that layer's tensors
(``load_state_dict(assign=True)``), run over every sequence, and dropped before the next
layer is read. Around the layers everything is computed as transformers'
``Gemma4TextModel.forward`` / ``Gemma4ForCausalLM.forward`` computes it (huggingface/
transformers ``src/transformers/models/gemma4/modeling_gemma4.py``): the scaled embedding
(rows times ``sqrt(hidden_size)`` cast to the weight dtype), per layer the rotary
embedding of that layer's type (``Gemma4TextRotaryEmbedding(x, position_ids, layer_type)``:
sliding and full attention have their own RoPE) and the mask of that type
(``masking_utils.create_causal_mask`` for full, ``create_sliding_window_causal_mask`` for
sliding layers), then the final ``Gemma4RMSNorm``, the lm_head (the embedding when tied) and
the final logit softcap ``tanh(z / c) * c``.

Two weight sources share that forward: :class:`SourceStream` reads a bf16 source (names
mapped by the same table the converters use, so the pre-release ``moe.*`` names work), and
:class:`Nvfp4Stream` reads a modelopt NVFP4 result dequantized per layer by
:func:`g4.convert.reference.load_nvfp4_as_hf`, with W4A4 activation fake-quant installed
on the layer by :func:`g4.convert.reference.install_activation_quant` when asked.

Memory: the hidden states of every sequence (``[1, S_i, H]`` each, compute dtype) and the
KV caches of a generation, plus one decoder layer (one side at a time: source and result
layers are never in RAM together), or, in the head phase, the final norm and the
``[V, H]`` head. The embedding is read row by row (only the rows of the tokens used).

What a comparison computes from SRC alone (``verify``'s continuations and hidden states,
``eval``'s last hidden states) is kept between runs by :class:`SourceSideCache`
(``G4_SOURCE_CACHE``): a later comparison against the same SRC reads only its head.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from g4.convert.reference import compare_logprobs, install_activation_quant, load_nvfp4_as_hf
from g4.convert.sources import checked_sources
from g4.core.checkpoint import Checkpoint, FileRecords
from g4.core.errors import CheckpointError
from g4.core.gemma4 import LM_HEAD, embed_scale
from g4.core.positions import LayerPositions, PositionBuilder
from g4.quantizers.compiled import private_to_user, user_cache_dir
from g4.exporters.neuron_int8 import (
    check_rank_files,
    dequantized_local,
    geometry,
    host_rows,
    is_rank_index,
    layer_entries,
    layer_prefix,
    model_entries,
    unshard,
)

log = logging.getLogger(__name__)


class StreamedModel:
    """A Gemma 4 language model in a checkpoint, run one decoder layer at a time.

    Subclasses say where a layer's tensors come from (:meth:`layer_tensors`).

    Args:
        ckpt: the opened checkpoint.
        dtype: compute dtype (weights are cast to it as a layer is loaded).
        device: where layers and the head run (``"cpu"``, ``"cuda"``); :meth:`embed` returns
            hidden states there. Weights are read on the host and moved one layer at a time.

    Raises:
        CheckpointError: transformers cannot build a Gemma 4 config from ``config.json``.
    """

    #: Called each time :meth:`layer` builds a decoder layer (a progress bar counts passes over the layers).
    on_layer: Callable[[], None] | None = None

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self._setup(ckpt.root, dtype, device)
        self.ckpt = ckpt
        self.num_layers = ckpt.num_layers
        self.embed_name = ckpt.prefix + "embed_tokens.weight"
        self.head_name = self.embed_name if ckpt.arch.tied else LM_HEAD

    def _setup(self, root: Path, dtype: torch.dtype, device: str | torch.device) -> None:
        """The transformers text config of ``root/config.json``, compute dtype, device and RoPE."""
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(root, experts_implementation="eager")
        except Exception as e:  # transformers raises many types for bad configs
            raise CheckpointError(f"{root / 'config.json'}: transformers cannot build a config: {e}") from e
        self.root = Path(root)
        self.config = config.get_text_config()
        self.config._attn_implementation = "sdpa"
        self.config._experts_implementation = "eager"
        self.dtype = dtype
        self.device = torch.device(device)
        self.rope = PositionBuilder(self.config)

    def close(self) -> None:
        """Unmap the files read so far (their pages would otherwise stay in this process's RSS)."""
        self.ckpt.close()

    def layer_tensors(self, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``({state-dict key inside the layer: tensor}, {module inside the layer: input_scale})``."""
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[S]`` token ids -> ``[1, S, H]`` scaled embeddings in the compute dtype,
        as ``Gemma4TextScaledWordEmbedding`` of a model in that dtype (the scale cast to it:
        ``bf16(sqrt(2816)) = 53.0`` in bf16)."""
        rows = self.ckpt.get_rows(self.embed_name, ids).to(self.dtype)
        self.close()
        scale = torch.tensor(embed_scale(self.config.hidden_size, self.dtype), dtype=self.dtype)
        return (rows * scale).unsqueeze(0).to(self.device)

    def layer(self, layer: int) -> nn.Module:
        """Decoder layer ``layer`` with its weights (compute dtype), eval mode.

        Raises:
            CheckpointError: the layer's tensors are not exactly those the module has.
        """
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

        tensors, input_scales = self.layer_tensors(layer)
        self.close()  # unmap the shards: their pages read so far would otherwise stay in this process's RSS
        with torch.device("meta"):
            module = Gemma4TextDecoderLayer(self.config, layer)
        try:
            module.load_state_dict({k: v.to(self.dtype) for k, v in tensors.items()}, strict=True, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"{self.root}: layer {layer}'s tensors do not fit transformers' "
                                  f"Gemma4TextDecoderLayer: {str(e).splitlines()[-1].strip()}") from e
        module.to(self.device).eval()
        if input_scales:
            install_activation_quant(module, {k: v.to(self.device) for k, v in input_scales.items()})
        if self.on_layer is not None:
            self.on_layer()
        return module

    def head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The final norm + lm_head + softcap, loaded now: ``[..., H] -> [..., V]`` logits in
        the compute dtype (as ``Gemma4ForCausalLM.forward``)."""
        return self._head(*self.head_weights())

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(final norm weight [H], head weight [V, H])`` as the checkpoint stores them (the
        embedding when tied), for :meth:`_head`."""
        return self.final_norm_weight(), self.ckpt.get(self.head_name)

    def final_norm_weight(self) -> torch.Tensor:
        """The final norm's weight ``[H]`` as stored."""
        return self.ckpt.read(self.ckpt.prefix + "norm.weight")

    def head_equals(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`head_weights` would return ``weight`` (``[V, H]``) as its head: same
        dtype, shape and bits, compared block by block from the file (:meth:`Checkpoint.equals`),
        never a second ``[V, H]`` copy in RAM (a tied NVFP4 result keeps its source's bf16
        embedding)."""
        return self.ckpt.equals(self.head_name, weight)

    def _head(self, norm_weight: torch.Tensor, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        norm = Gemma4RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.load_state_dict({"weight": norm_weight.to(self.dtype)}, assign=True)
        norm.to(self.device)
        weight = weight.to(self.device, self.dtype)
        self.close()
        cap = self.config.final_logit_softcapping

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            z = nn.functional.linear(norm(hidden), weight)
            return z if cap is None else torch.tanh(z / cap) * cap

        return logits


class SourceStream(StreamedModel):
    """A bf16/fp16/fp32 source checkpoint (``Checkpoint(source=True)`` checks), tensors named by
    the converters' name table (:func:`g4.convert.sources.checked_sources`)."""

    def __init__(self, src: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        ckpt = Checkpoint(src, source=True)
        super().__init__(ckpt, dtype, device)
        self._layers = [ls.tensors for ls in checked_sources(ckpt).layers]

    def layer_tensors(self, layer: int):
        # views of the shards' mapping, not copies: copies by positioned reads (which would turn a
        # SRC file cut short mid-run from a SIGBUS into a CheckpointError) made bench_verify.py
        # --layers 2 take 63.0 / 53.2 s against 50.8 / 40.1 s (2026-12-06, A/B): each pass over SRC
        # then faults in a new decoder layer's worth of memory
        return {suffix: self.ckpt.get(name) for suffix, name in self._layers[layer].items()}, {}


class Nvfp4Stream(StreamedModel):
    """A modelopt NVFP4 result, dequantized one layer at a time by
    :func:`g4.convert.reference.load_nvfp4_as_hf`; ``act_quant``: W4A4 activation fake-quant
    against each quantized module's ``input_scale`` (as ``load_converted_model``)."""

    def __init__(self, out: str | Path, dtype: torch.dtype = torch.bfloat16, *, act_quant: bool = False,
                 device: str | torch.device = "cpu"):
        super().__init__(Checkpoint(out), dtype, device)
        self.act_quant = act_quant

    def layer_tensors(self, layer: int):
        prefix = self.ckpt.layer_prefix(layer)
        sd, input_scales = load_nvfp4_as_hf(self.ckpt, self.dtype, prefix=prefix)
        strip = len(prefix)
        scales = {k[strip:]: v for k, v in input_scales.items()} if self.act_quant else {}
        return {k[strip:]: v for k, v in sd.items()}, scales


class Int8NeuronStream(StreamedModel):
    """A ``g4convert int8-neuron`` result, one decoder layer at a time: each layer's tensors read
    from every TP rank file (only that layer's), dequantized per rank
    (:func:`g4.exporters.neuron_int8.dequantized_local`) and put back together in the Hugging
    Face layout by the layout table's own rules (:func:`g4.exporters.neuron_int8.unshard`), so
    no name or split is written twice. The embedding is the host table's rows times the
    manifest's ``embed_scale`` rounded to the table dtype, and the head the vocabulary-sharded
    int8 lm_head, as ``g4.serve.neuron_emulator`` computes them; the unsharded forward differs
    from the emulator's per-rank partial sums only by summation order.

    Memory: one layer of every rank (int8) and its dequantized whole in ``dtype``; the head
    phase the ``[V, H]`` lm_head.

    Raises:
        CheckpointError: the result differs from the layout table
            (:func:`g4.exporters.neuron_int8.check_rank_files`, headers only) or a rank file
            cannot be read.
    """

    def __init__(self, out: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        manifest, config, self._paths = check_rank_files(out)
        self._setup(Path(out), dtype, device)
        self.manifest = manifest
        self.geom = geometry(config, manifest.tp_degree)
        self.num_layers = self.geom.num_layers
        self._open: list = []

    def close(self) -> None:
        self._open.clear()  # safe_open handles unmap when dropped

    def _read(self, names_of: Callable[[str], bool]) -> list[dict[str, torch.Tensor]]:
        """Per rank, the tensors of its file whose names ``names_of`` accepts."""
        from safetensors import SafetensorError, safe_open

        ranks = []
        try:
            for path in self._paths:
                f = safe_open(path, framework="pt")
                self._open.append(f)
                ranks.append({k: f.get_tensor(k) for k in f.keys() if names_of(k)})
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{path}: unreadable rank file ({type(e).__name__}: {e})") from e
        return ranks

    def _gathered(self, entries, prefix: str, layer: int | None) -> dict[str, torch.Tensor]:
        entries = [e for e in entries if not is_rank_index(e)]
        wanted = {n for e in entries for n in e.names(prefix)}
        ranks = self._read(wanted.__contains__)
        out = {}
        for e in entries:
            try:
                parts = [dequantized_local(e, sd, prefix, self.dtype) for sd in ranks]
            except KeyError as err:
                raise CheckpointError(f"{self.root}: a rank file has no tensor {err.args[0]}") from err
            out[e.source] = unshard(e, parts, self.geom, layer)
            for sd in ranks:  # drop the rank-local copies as soon as the whole is built
                for n in e.names(prefix):
                    sd.pop(n, None)
        return out

    def layer_tensors(self, layer: int):
        g = self.geom
        entries = layer_entries(has_v=g.has_v[layer], quantize_attention=self.manifest.quantize_attention)
        return self._gathered(entries, layer_prefix(layer), layer), {}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        picked = host_rows(self.root, self.manifest.host_embedding, ids)
        scaled = picked * torch.tensor(self.manifest.embed_scale).to(picked.dtype)
        return scaled.to(self.dtype).unsqueeze(0).to(self.device)

    def head_weights(self):
        entries = [e for e in model_entries(tied=self.geom.arch.tied) if e.key in ("norm", "lm_head")]
        got = self._gathered(entries, "", None)
        norm = next(e for e in entries if e.key == "norm")
        lm = next(e for e in entries if e.key == "lm_head")
        return got.pop(norm.source), got.pop(lm.source)

    def final_norm_weight(self) -> torch.Tensor:
        entries = [e for e in model_entries(tied=self.geom.arch.tied) if e.key == "norm"]
        return self._gathered(entries, "", None)[entries[0].source]

    def head_equals(self, weight: torch.Tensor) -> bool:
        """False: the head is the dequantized int8 lm_head, never a source's bf16 bytes."""
        return False


def run_layer(module: nn.Module, layer: int, hidden: torch.Tensor, pos: LayerPositions, cache=None) -> torch.Tensor:
    """Decoder layer ``layer`` (transformers' ``Gemma4TextDecoderLayer``) on ``hidden``
    ``[1, S, hidden_size]`` at the positions ``pos`` (its layer type's mask and RoPE); ``cache``:
    a transformers cache to extend (decode), or None. Returns the layer's output, same shape."""
    layer_type = module.config.layer_types[layer]
    return module(hidden, None, shared_kv_states={}, position_embeddings=pos.rope[layer_type],
                  attention_mask=pos.masks[layer_type], position_ids=pos.ids, cache=cache)


@torch.no_grad()
def streamed_logits(model: StreamedModel, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Logits of every position of each sequence, one decoder layer in RAM at a time.

    Returns:
        per sequence ``[S_i, V]`` logits in the compute dtype (what the whole transformers
        model returns for ``model(ids).logits[0]``).
    """
    hidden = [model.embed(torch.tensor(list(s))) for s in sequences]
    pos = [model.rope.positions(h, 0) for h in hidden]
    for layer in range(model.num_layers):
        module = model.layer(layer)
        hidden = [run_layer(module, layer, h, p) for h, p in zip(hidden, pos)]
        del module
    head = model.head()
    return [head(h)[0] for h in hidden]


def _decode_pass(model: StreamedModel, feed: dict[int, list[int]], caches: dict, past: dict[int, int]
                 ) -> dict[int, torch.Tensor]:
    """Run each sequence's new tokens ``feed[i]`` (after ``past[i]`` cached ones) through every
    layer, updating ``caches[i]``; return each sequence's last-position logits ``[V]``."""
    hidden = {i: model.embed(torch.tensor(t)) for i, t in feed.items()}
    pos = {i: model.rope.positions(h, past[i], caches[i]) for i, h in hidden.items()}
    for layer in range(model.num_layers):
        module = model.layer(layer)
        hidden = {i: run_layer(module, layer, h, pos[i], caches[i]) for i, h in hidden.items()}
        del module
    head = model.head()
    return {i: head(h[0, -1]) for i, h in hidden.items()}


def new_cache(model: StreamedModel):
    """An empty transformers ``DynamicCache`` for ``model`` (sliding layers keep their window)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.no_grad()
def decode_step(model: StreamedModel, cache, ids: Sequence[int], past: int) -> torch.Tensor:
    """One pass over the layers for one sequence: ``ids`` follow the ``past`` tokens already in
    ``cache`` (from :func:`new_cache`; updated). Returns fp32 ``[V]`` logits of the last position."""
    return _decode_pass(model, {0: list(ids)}, {0: cache}, {0: past})[0].float()


@torch.no_grad()
def streamed_greedy(model: StreamedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    eos_token_ids: Sequence[int] = ()) -> list[list[int]]:
    """Greedy continuation of each prompt (as ``generate(do_sample=False)``: argmax, stop after
    an EOS id, which is kept), all prompts advanced together one token per pass over the layers.

    Each prompt keeps transformers' ``DynamicCache`` for every layer (sliding layers keep their
    window), so a pass computes only the new token of each prompt; the cost of a pass is reading
    every layer once (and the head). Memory: the caches (``2 x S x kv_heads x head_dim`` per
    layer and prompt) beside one layer.

    Returns:
        the generated ids of each prompt (at most ``max_new_tokens``, ending at an EOS id).
    """
    eos = set(eos_token_ids)
    caches = {i: new_cache(model) for i in range(len(prompts))}
    new: list[list[int]] = [[] for _ in prompts]
    feed = {i: list(p) for i, p in enumerate(prompts)}  # tokens each live prompt has not run yet
    past = {i: 0 for i in feed}
    for _ in range(max_new_tokens):
        for i, logits in _decode_pass(model, feed, caches, past).items():
            token = int(logits.argmax(-1))
            new[i].append(token)
            past[i] += len(feed[i])
            feed[i] = [token]
            if token in eos:
                del feed[i]
        if not feed:
            break
    return new


@torch.no_grad()
def source_side(src: StreamedModel, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]
                ) -> dict[str, torch.Tensor]:
    """SRC teacher-forced over ``sequences`` (each a prompt of ``prompt_lengths[i]`` tokens and its
    continuation), one decoder layer at a time: what :func:`compare_streamed` needs of SRC.

    Returns:
        ``"final.{i}"``: sequence i's last decoder layer output ``[S_i, H]``; ``"layer.{L}"``: layer
        L's output at the continuation positions of every sequence (those whose logits predict a
        continuation token, ``p_i - 1 .. S_i - 2``), concatenated in sequence order,
        ``[sum_i (S_i - p_i), H]``; all in SRC's compute dtype, on its device.
    """
    seqs = [torch.tensor(list(s)) for s in sequences]
    hidden = [src.embed(s) for s in seqs]
    pos = [src.rope.positions(h, 0) for h in hidden]
    reply = [slice(p - 1, len(s) - 1) for p, s in zip(prompt_lengths, seqs)]
    side = {}
    for layer in range(src.num_layers):
        module = src.layer(layer)
        hidden = [run_layer(module, layer, h, p) for h, p in zip(hidden, pos)]
        del module
        side[f"layer.{layer}"] = torch.cat([h[0, r] for h, r in zip(hidden, reply)])
    side.update({f"final.{i}": h[0] for i, h in enumerate(hidden)})
    return side


def source_side_shapes(src: StreamedModel, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]
                       ) -> dict[str, tuple[int, ...]]:
    """The shapes of :func:`source_side`'s tensors (what a kept entry must hold)."""
    hidden = src.config.hidden_size
    replies = sum(len(s) - p for s, p in zip(sequences, prompt_lengths))
    return {**{f"layer.{L}": (replies, hidden) for L in range(src.num_layers)},
            **{f"final.{i}": (len(s), hidden) for i, s in enumerate(sequences)}}


@torch.no_grad()
def compare_streamed(src: StreamedModel, res: StreamedModel, sequences: Sequence[Sequence[int]],
                     prompt_lengths: Sequence[int], src_side: dict[str, torch.Tensor] | None = None) -> dict:
    """Teacher-force source and result on the same sequences, one decoder layer at a time
    (SRC's layers over every sequence, then the result's; never two layers in RAM), and compare
    them.

    Args:
        src, res: the source and the converted model (same architecture).
        sequences: each prompt followed by the source's greedy continuation of it.
        prompt_lengths: tokens of each prompt (the continuation starts there).
        src_side: SRC's :func:`source_side` on these sequences where already known (verify's entry
            in :class:`SourceSideCache`): SRC's decoder layers are then not run (nor read).

    Returns:
        :func:`g4.convert.reference.compare_logprobs`' figures (token agreement and
        KL(source || result) in nats, over continuation positions and over all positions),
        plus ``"layer_rel_error"``: per decoder layer, ``||h_res - h_src|| / ||h_src||`` of
        that layer's output hidden states (Frobenius norms, fp32) over the continuation
        positions of every sequence (those whose logits predict a continuation token), the
        result having run on its own hidden states from the embedding on.
    """
    if src_side is None:
        src_side = source_side(src, sequences, prompt_lengths)
    seqs = [torch.tensor(list(s)) for s in sequences]
    h_res = [res.embed(s) for s in seqs]
    pos = [res.rope.positions(h, 0) for h in h_res]
    reply = [slice(p - 1, len(s) - 1) for p, s in zip(prompt_lengths, seqs)]
    at = [0]  # each sequence's first row in src_side["layer.L"]
    for r in reply:
        at.append(at[-1] + r.stop - r.start)
    rel = []
    for layer in range(res.num_layers):
        module = res.layer(layer)
        h_res = [run_layer(module, layer, h, p) for h, p in zip(h_res, pos)]
        del module
        kept = src_side[f"layer.{layer}"].to(res.device)
        s_rows = [kept[at[i] : at[i + 1]] for i in range(len(seqs))]
        err = sum(float((q[0, r].float() - s.float()).square().sum()) for q, s, r in zip(h_res, s_rows, reply))
        ref = sum(float(s.float().square().sum()) for s in s_rows)
        rel.append((err / ref) ** 0.5 if ref > 0 else float("nan"))
    head = src.head()
    logprobs_src = [torch.log_softmax(head(src_side[f"final.{i}"].to(src.device)[None])[0, :-1].float(), -1)
                    for i in range(len(seqs))]
    del head
    head = res.head()
    stats = compare_logprobs(
        (lp, torch.log_softmax(head(h)[0, :-1].float(), -1), r.start) for lp, h, r in zip(logprobs_src, h_res, reply))
    return {**stats, "layer_rel_error": rel}


# --------------------------------------------------------------------------- SRC's side, kept

# Where eval and verify keep SRC's side of a comparison between runs (SourceSideCache): this
# variable's directory, or ``off`` (or ``0``) for none; default ``~/.cache/g4/source``.
SOURCE_CACHE_ENV = "G4_SOURCE_CACHE"
_SIDE_FORMAT = "g4-source-side-1"  # part of every entry's key: bump when what is stored changes
# The g4 packages whose code computes SRC's side (stream, eval, verify, the name table, the
# checkpoint reader, ...): an edit to any of their modules never reuses an entry.
_SIDE_CODE = ("g4.quantizers", "g4.core", "g4.exporters", "g4.convert")
# Seconds after which a temporary file left in the cache (a process killed while writing) is removed.
_STALE_PARTIAL_SECONDS = 3600


@functools.cache
def _code_digest() -> str:
    """sha256 of every ``*.py`` file of the packages :data:`_SIDE_CODE` (names and bytes)."""
    h = hashlib.sha256()
    for package in _SIDE_CODE:
        for folder in importlib.import_module(package).__path__:
            for f in sorted(Path(folder).glob("*.py")):
                h.update(f"{package}.{f.name}\n".encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def _json_input(value):
    """An input of the key as JSON: tensors by dtype, shape and the sha256 of their bytes."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        return {"dtype": str(t.dtype), "shape": list(t.shape),
                "sha256": hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()}
    return value


class SourceSideCache:
    """What a comparison computed from SRC alone, kept between runs: ``g4convert eval``'s SRC last
    hidden states, ``verify``'s SRC continuations and hidden states (a few MB to tens of MB), with
    a JSON object of facts about SRC (eval's provenance, the sha256 of a local SRC's weight files).
    A later comparison of another result against the same SRC on the same inputs then reads SRC's
    head only (its embedding and final norm), not its decoder layers nor the rest of its files:
    on the real 26B-A4B about 1.5 GB of its 51.6 GB (``verify`` reads SRC once per new token
    without it).

    An entry is one safetensors file in :func:`g4.quantizers.compiled.user_cache_dir`
    ``("source", G4_SOURCE_CACHE)`` named by the sha256 of everything SRC's side depends on:
    ``kind`` and ``inputs`` (token ids as the sha256 of their bytes), every SRC weight file's
    resolved path and :func:`g4.core.checkpoint.file_identity` (size, inode, device, mtime and
    ctime: any write to a file changes its ctime; a copy of SRC is another SRC), SRC's ``config.json``, the compute dtype, device type and CPU threads,
    torch's and transformers' versions and g4's code (every module of :data:`_SIDE_CODE`). It is
    used only from a directory and a file this user owns that no one else can write
    (:func:`g4.quantizers.compiled.private_to_user`) and only when its recorded key and the shapes
    the caller expects match; otherwise the caller computes SRC's side as without a cache (a warning
    says why). Written atomically (a temp file, renamed). Safetensors only: loading runs no code.

    Args:
        kind: what is kept (``"eval"``, ``"verify"``).
        src: SRC's layer-streamed model (its checkpoint's weight files, config, dtype, device).
        inputs: JSON-able values and tensors SRC's side is computed from (token ids, settings).
    """

    def __init__(self, kind: str, src: StreamedModel, inputs: dict):
        from transformers import __version__ as transformers_version

        self.kind = kind
        self.root = user_cache_dir("source", SOURCE_CACHE_ENV)
        self.dtype = src.dtype
        # each shard as it was when SRC was opened, by the path SRC names it with (a file rewritten
        # or a link retargeted since, even before this key was taken, is seen by changed())
        self._records = FileRecords.of_checkpoint(src.ckpt)
        self.files = self._records.files
        key = {"format": _SIDE_FORMAT, "kind": kind, "inputs": {k: _json_input(v) for k, v in inputs.items()},
               "files": self.files, "config": hashlib.sha256((src.root / "config.json").read_bytes()).hexdigest(),
               "dtype": str(src.dtype), "device": src.device.type,
               "threads": torch.get_num_threads() if src.device.type == "cpu" else None,
               "torch": torch.__version__, "transformers": transformers_version, "code": _code_digest()}
        self.key = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        self.path = None if self.root is None else self.root / f"{kind}-{self.key}.safetensors"

    def load(self, shapes: "dict[str, tuple[int, ...]] | Callable[[dict], dict[str, tuple[int, ...]]]"
             ) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The kept tensors (CPU, copies) and facts, or None: no cache, no entry, or one not to be
        trusted (warned: not this user's own, unreadable, another key, or not exactly the tensors
        ``shapes`` names, in those shapes; floating tensors must be in SRC's compute dtype).
        ``shapes`` may be a function of the kept facts (e.g. the lengths of kept continuations)."""
        if self.path is None:
            return None
        try:
            self.path.lstat()
        except FileNotFoundError:
            return None
        except OSError as e:  # a cache folder this user cannot enter
            log.warning("%s: cannot be read (%s, %s); computing SRC's side again", self.path, e.strerror or e,
                        SOURCE_CACHE_ENV)
            return None
        if not private_to_user(self.root, directory=True) or not private_to_user(self.path, directory=False):
            log.warning("%s: not a file only this user can write in a directory only this user can write (%s); "
                        "computing SRC's side again", self.path, SOURCE_CACHE_ENV)
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                # copies, not the file's mapping (a file truncated meanwhile would SIGBUS)
                tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
            facts = json.loads(meta.get("facts", ""))
        except Exception as e:  # noqa: BLE001 - safetensors and json raise several types for a damaged file
            log.warning("%s: unreadable (%s); computing SRC's side again", self.path, type(e).__name__)
            return None
        try:
            shapes = shapes(facts) if callable(shapes) and isinstance(facts, dict) else shapes
        except (KeyError, TypeError, ValueError):  # facts not of the form the caller keeps
            shapes = None
        ok = (meta.get("key") == self.key and isinstance(facts, dict) and isinstance(shapes, dict)
              and set(tensors) == set(shapes)
              and all(tuple(t.shape) == tuple(shapes[n]) and (not t.is_floating_point() or t.dtype == self.dtype)
                      for n, t in tensors.items()))
        if not ok:
            log.warning("%s: not the entry for this SRC, its inputs and settings; computing SRC's side again",
                        self.path)
            return None
        log.info("SRC's side from the source cache (%s): SRC's decoder layers are not read", self.path)
        return tensors, facts

    def reading(self, root: "str | os.PathLike[str]", command: str):
        """:meth:`g4.core.checkpoint.FileRecords.reading` of SRC's weight files."""
        return self._records.reading(root, command)

    def check_unchanged(self, root: "str | os.PathLike[str]", command: str) -> None:
        """:meth:`g4.core.checkpoint.FileRecords.check_unchanged` of SRC's weight files."""
        self._records.check_unchanged(root, command)

    def changed(self) -> str | None:
        """The shard name (e.g. ``model-00001-of-00002.safetensors``) of the first SRC weight file
        whose resolved path or :func:`g4.core.checkpoint.file_identity` is no longer what it was
        when the key was taken (rewritten, replaced, a link retargeted, removed), or None: what
        was computed from SRC since may hold bytes of another file (:class:`FileRecords`)."""
        return self._records.changed()

    def save(self, tensors: dict[str, torch.Tensor], facts: dict) -> None:
        """Keep ``tensors`` and ``facts`` (a JSON object) as this key's entry; a cache that cannot
        be written (or is not this user's own) is warned about, never an error. Nothing is kept
        when SRC changed since the key was taken (:meth:`changed`)."""
        from safetensors.torch import save_file

        if self.path is None:
            return
        if (name := self.changed()) is not None:
            log.warning("%s: changed while SRC's side was computed; SRC's side not kept", name)
            return
        tmp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not private_to_user(self.root, directory=True):
                log.warning("%s: not a directory only this user can write (%s); SRC's side not kept",
                            self.root, SOURCE_CACHE_ENV)
                return
            self._remove_stale_partials()
            fd, tmp = tempfile.mkstemp(prefix=".partial-", suffix=".safetensors", dir=self.root)
            os.close(fd)
            save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, tmp,
                      metadata={"key": self.key, "kind": self.kind, "facts": json.dumps(facts, sort_keys=True)})
            os.replace(tmp, self.path)
            tmp = None
        except Exception as e:  # noqa: BLE001 - OSError, and safetensors' own error for a failed write
            log.warning("%s: SRC's side not kept (%s)", self.root, getattr(e, "strerror", None) or e)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _remove_stale_partials(self) -> None:
        """Temporary files of writes killed midway (``.partial-*``, safetensors' own ``.tmp*``),
        older than :data:`_STALE_PARTIAL_SECONDS`: never trusted (not entries), only removed."""
        now = time.time()
        for f in [*self.root.glob(".partial-*"), *self.root.glob(".tmp*")]:
            try:
                if now - f.lstat().st_mtime > _STALE_PARTIAL_SECONDS:
                    f.unlink()
            except OSError:
                pass
