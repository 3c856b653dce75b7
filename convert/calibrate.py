"""Activation calibration one decoder layer at a time (only that layer's weights in RAM).

Calibration text is tokenized, cut into ``[N, S]`` samples, embedded on the host
(``embed_tokens`` rows times ``bf16(sqrt(hidden_size))``, exactly as
``Gemma4TextScaledWordEmbedding`` does), then pushed through the checkpoint's decoder
layers in order with transformers' own ``Gemma4TextDecoderLayer`` in the checkpoint
dtype. For every quantizable linear the max ``|x|`` of its input is recorded; this is
what modelopt's max calibrator records (``NVFP4_DEFAULT_CFG``, ``algorithm: max``).

Experts follow modelopt's ``_QuantFusedExperts`` (Model-Optimizer
``modelopt/torch/quantization/plugins/huggingface.py``): one input amax shared by all
experts of a layer per projection kind, over the tokens routed to them (gate/up input)
and over ``act(gate) * up`` of every routed (token, expert) pair (down input). Because
the scale is shared, experts that no calibration token reached still get a finite,
positive ``input_scale`` (case P04).

With ``kv_cache=True`` (``g4convert nvfp4 --kv-cache-dtype fp8``) each attention also records
``max|k|`` and ``max|v|`` of the key and value states exactly where modelopt's
``k_bmm_quantizer`` / ``v_bmm_quantizer`` see them (:func:`record_kv_amax`).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from g4.convert.options import text_file_suffix
from g4.core.checkpoint import Checkpoint
from g4.core.errors import CheckpointError, G4Error
from g4.core.gemma4 import EXPERT_DOWN, EXPERT_GATE_UP, embed_scale
from g4.core.positions import PositionBuilder
from g4.exporters.nvfp4_names import DENSE_GROUPS, KV_AMAX_KEYS, Role

_DENSE_MODULES = frozenset(m for g in DENSE_GROUPS for m in g.members)  # the dense linears calibrated

log = logging.getLogger(__name__)

DEFAULT_CALIB_FILE = Path(__file__).parent / "data" / "calibration.jsonl"
# Defaults of every command that calibrates (g4convert nvfp4; int8-neuron --algorithm gptq):
# samples x tokens per sample, samples per layer forward, forward dtype, device.
CALIB_SAMPLES, CALIB_SEQ_LEN, CALIB_BATCH_SIZE = 32, 256, 8
CALIB_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CALIB_DTYPE, CALIB_DEVICE = "float32", "auto"
# GPTQ: an expert that fewer calibration (token, expert) pairs reached than this is not GPTQ'd
# (its Hessian would be mostly damping): each format's fallback quantizes it, logged
# (:meth:`LayerHessians.expert_batches`).
GPTQ_MIN_TOKENS = 32
# experts GPTQ'd together (one batched column loop): bounds the fp32 inverse-Hessian factors to
# 8 * 4 * in**2 bytes (254 MB at in = 2816) while the loop's per-column cost is shared
GPTQ_EXPERT_BATCH = 8


def check_text_file(path: str | Path, option: str = "--calib-data") -> str:
    """How :func:`read_calibration_texts` reads ``path`` (given to ``option``): ``".txt"`` or
    ``".jsonl"``; another suffix is refused (:func:`g4.convert.options.text_file_suffix`).

    Raises:
        OptionError: a suffix other than ``.txt`` / ``.jsonl``.
    """
    return text_file_suffix(path, option, "documents separated by blank lines",
                            "one object per line with 'text' or chat 'messages'")


def read_calibration_texts(path: str | Path | None, tokenizer=None, *, what: str = "calibration",
                           default: Path = DEFAULT_CALIB_FILE, option: str = "--calib-data") -> list[str]:
    """Read calibration documents.

    Args:
        path: ``.jsonl`` (one JSON object per line with ``"text"``, or ``"messages"``
            rendered through the tokenizer's chat template) or ``.txt`` (documents separated
            by blank lines); any other suffix is refused (:func:`check_text_file`). ``None``
            uses the packaged default.
        tokenizer: needed only for ``"messages"`` records.
        what: the kind of text named in error messages (``g4convert eval`` reads its held-out
            text with ``"evaluation"``).
        default: the file read when ``path`` is None.
        option: the command-line option ``path`` came from, for the messages.

    Returns:
        Non-empty list of documents.

    Raises:
        OptionError: a suffix other than ``.txt`` / ``.jsonl``.
        G4Error: unreadable file, bad JSON line, or no text.
    """
    if path is not None:
        check_text_file(path, option)
    path = Path(path) if path is not None else default
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise G4Error(f"{path}: cannot read {what} data: {e}") from e
    docs: list[str] = []
    if path.suffix.lower() == ".jsonl":
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise G4Error(f"{path}:{lineno}: invalid JSON: {e}") from e
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                docs.append(rec["text"])
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                if tokenizer is None:
                    raise G4Error(f"{path}:{lineno}: 'messages' records need a tokenizer with a chat template")
                try:
                    docs.append(tokenizer.apply_chat_template(rec["messages"], tokenize=False))
                except Exception as e:  # jinja/transformers raise many types for bad messages
                    raise G4Error(f"{path}:{lineno}: cannot render 'messages' with the chat template: {e}") from e
            else:
                raise G4Error(f"{path}:{lineno}: expected an object with a string 'text' or a list 'messages'")
    else:
        docs = [d.strip() for d in raw.split("\n\n") if d.strip()]
    if not docs:
        raise G4Error(f"{path}: no {what} text")
    return docs


def make_calibration_ids(tokenizer, docs: Iterable[str], *, samples: int, seq_len: int) -> torch.Tensor:
    """Tokenize documents, concatenate them (each starts with ``<bos>``) and cut into samples.

    Returns:
        int64 ``[n, seq_len]`` with ``1 <= n <= samples`` (fewer when the text is short;
        logged).

    Raises:
        G4Error: fewer than ``seq_len`` tokens in all.
    """
    stream: list[int] = []
    for doc in docs:
        stream.extend(tokenizer(doc, add_special_tokens=True)["input_ids"])
        if len(stream) >= samples * seq_len:
            break
    n = min(samples, len(stream) // seq_len)
    if n == 0:
        raise G4Error(f"calibration text has {len(stream)} tokens, fewer than one sample of {seq_len}; "
                      "lower --calib-seq-len or give more text with --calib-data")
    if n < samples:
        log.warning("calibration text gives %d samples of %d tokens, not the %d asked for", n, seq_len, samples)
    return torch.tensor(stream[: n * seq_len], dtype=torch.int64).reshape(n, seq_len)


def _record_max(stats: dict[str, torch.Tensor], key: str, x: torch.Tensor) -> torch.Tensor:
    if x.numel():
        amax = x.detach().abs().amax().float()
        stats[key] = torch.maximum(stats[key], amax) if key in stats else amax
    return x


def experts_forward_with_input_hook(experts: nn.Module, on_input: Callable[..., torch.Tensor], *,
                                    with_expert: bool = False):
    """A forward for ``Gemma4TextExperts`` that passes the input of each expert linear
    through ``on_input(kind, x)`` (kind ``"experts.gate_up_proj"`` or ``"experts.down_proj"``),
    which may record it (calibration) or replace it (activation fake-quant in verify);
    ``with_expert`` calls ``on_input(kind, x, expert)`` with the expert's index (Hessians).

    Expert weights are cast to the activation dtype one expert at a time (a no-op when
    they match), so bf16 experts can serve an fp32 forward without an fp32 copy of the
    layer. Otherwise the same arithmetic as transformers' eager experts forward: experts in ascending order,
    ``gate | up = x @ gate_up_proj[e].T``, ``act(gate) * up``, ``@ down_proj[e].T``,
    times the routing weight, accumulated with ``index_add_``.
    Shapes: hidden_states ``[T, H]``, top_k_index int64 ``[T, K]``, top_k_weights ``[T, K]``.
    """

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            slot, token = torch.where((top_k_index == expert).T)
            extra = (expert,) if with_expert else ()
            x = on_input("experts.gate_up_proj", hidden_states[token], *extra)
            gate, up = nn.functional.linear(x, experts.gate_up_proj[expert].to(x.dtype)).chunk(2, dim=-1)
            h = on_input("experts.down_proj", experts.act_fn(gate) * up, *extra)
            h = nn.functional.linear(h, experts.down_proj[expert].to(x.dtype)) * top_k_weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out

    return forward


_KV_RECORDING = "g4_kv_amax"  # the attention implementation name record_kv_amax registers


def _kv_recording_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    module.g4_on_kv(key, value)
    return module.g4_attention(module, query, key, value, attention_mask, **kwargs)


class _KvRecording:
    """What :func:`record_kv_amax` returns: ``remove()`` puts the attention's own config back."""

    def __init__(self, attention: nn.Module, config):
        self.attention, self.config = attention, config

    def remove(self) -> None:
        self.attention.config = self.config
        for name in ("g4_on_kv", "g4_attention"):
            self.attention.__dict__.pop(name, None)


def record_kv_amax(attention: nn.Module, stats: dict[str, torch.Tensor]) -> _KvRecording:
    """Record ``max|k|`` and ``max|v|`` of a ``Gemma4TextAttention`` into ``stats`` (keys
    :data:`g4.exporters.nvfp4_names.KV_AMAX_KEYS`: ``"self_attn.k_bmm"``, ``"self_attn.v_bmm"``;
    float32 ``[]``, the max over every call).

    Measured where modelopt 0.47 measures them: its ``_QuantAttention``
    (NVIDIA/Model-Optimizer ``modelopt/torch/quantization/plugins/huggingface.py``) wraps the
    attention function transformers' attention calls, so the amaxes are of the states passed to
    it: keys ``RoPE(k_norm(k_proj(x)))``, values ``v_norm(v_proj(x))`` (transformers 5.24
    ``models/gemma4/modeling_gemma4.py``, ``Gemma4TextAttention.forward``), ``[B, kv_heads, S,
    head_dim]`` in the compute dtype, every position of the sample (the sliding window is a mask,
    not a cut). On a k_eq_v full-attention layer (``attention_k_eq_v``, no v_proj) the values are
    ``v_norm(k_proj(x))``: K's projection without k_norm's scale and without RoPE, so V has an
    amax of its own (written as ``v_proj.v_scale``, as modelopt names it).

    This attention gets a copy of its config naming a registered attention function that records
    and then calls the configured one (``sdpa``); nothing global changes behaviour.

    Returns:
        an object whose ``remove()`` undoes it.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

    if _KV_RECORDING not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_KV_RECORDING, _kv_recording_attention)
    original = attention.config
    attention.g4_attention = ALL_ATTENTION_FUNCTIONS.get_interface(original._attn_implementation,
                                                                   eager_attention_forward)
    attention.g4_on_kv = lambda k, v: (_record_max(stats, KV_AMAX_KEYS[Role.K_SCALE], k),
                                       _record_max(stats, KV_AMAX_KEYS[Role.V_SCALE], v))
    attention.config = copy.copy(original)
    attention.config._attn_implementation = _KV_RECORDING
    return _KvRecording(attention, original)


# The dense linears that share their input (q/k/v, gate/up) share one Hessian, kept under the
# group's first member.
_HESSIAN_KEY = {m: g.members[0] for g in DENSE_GROUPS for m in g.members}


class LayerHessians:
    """``sum x^T x`` (fp32) of the calibration inputs of one decoder layer's linears, for GPTQ.

    Attributes:
        sums: ``{key: H}``: ``[in, in]`` for the dense linears (one per input: ``self_attn.q_proj``
            for q/k/v, ``mlp.gate_proj`` for gate/up, ``self_attn.o_proj``, ``mlp.down_proj``) and
            ``[E, in, in]`` for ``experts.gate_up_proj`` / ``experts.down_proj``, expert e's from
            the tokens routed to it only.
        tokens: ``{key: int64 [E]}`` for the experts: the (token, expert) pairs each expert saw.

    Memory: ``4 * in**2`` bytes per dense input and ``4 * E * in**2`` per expert kind; for
    gemma-4-26B-A4B (E = 128, gate_up in = 2816, down in = 704): 4.06 GB + 0.25 GB for the
    experts, 32 MB each for q/k/v and gate/up, ``4 * in**2`` for o_proj (in = heads * head_dim)
    and the dense down_proj (in = intermediate_size) (README, g4convert nvfp4, "Algorithms").
    """

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, torch.Tensor] = {}

    def get(self, module: str) -> torch.Tensor | None:
        """The Hessian of a dense linear's input (``"self_attn.k_proj"`` -> q/k/v's), or None."""
        return self.sums.get(_HESSIAN_KEY.get(module, module))

    def add_dense(self, key: str, x: torch.Tensor) -> torch.Tensor:
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        h = self.sums.get(key)
        if h is None:
            self.sums[key] = h = torch.zeros(x2.shape[-1], x2.shape[-1], device=x2.device)
        h.addmm_(x2.T, x2)
        return x

    def expert_batches(self, kind: str, n_experts: int, *, layer: int, fallback: str
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The experts of ``kind`` (``experts.gate_up_proj`` / ``experts.down_proj``) that GPTQ
        quantizes, :data:`GPTQ_EXPERT_BATCH` at a time: ``(int64 [b] expert indices, fp32 [b,
        in, in] their Hessians)``. The rule for every format: an expert reached by fewer than
        :data:`GPTQ_MIN_TOKENS` (token, expert) pairs (none recorded: 0) is left out, for the
        caller's ``fallback`` (named in the log line: NVFP4 ``mse``, int8 ``max``)."""
        tokens = self.tokens.get(kind, torch.zeros(n_experts, dtype=torch.int64))
        ok = [e for e in range(n_experts) if tokens[e] >= GPTQ_MIN_TOKENS]
        if len(ok) < n_experts:
            log.info("layer %d: %s: %d of %d experts saw fewer than %d calibration tokens: %s, not GPTQ",
                     layer, kind, n_experts - len(ok), n_experts, GPTQ_MIN_TOKENS, fallback)
        for i in range(0, len(ok), GPTQ_EXPERT_BATCH):
            idx = torch.tensor(ok[i : i + GPTQ_EXPERT_BATCH], dtype=torch.int64)
            yield idx, self.sums[kind][idx]

    def add_expert(self, key: str, x: torch.Tensor, expert: int, n_experts: int) -> torch.Tensor:
        x2 = x.detach().float()
        if key not in self.sums:
            self.sums[key] = torch.zeros(n_experts, x2.shape[-1], x2.shape[-1], device=x2.device)
            self.tokens[key] = torch.zeros(n_experts, dtype=torch.int64)
        self.sums[key][expert].addmm_(x2.T, x2)
        self.tokens[key][expert] += x2.shape[0]
        return x


class LayerCalibrator:
    """Runs calibration samples through the decoder layers one at a time.

    Memory: the hidden states ``[N, S, H]`` in the compute dtype plus one layer's
    weights (passed in by the caller, who also quantizes them; the non-expert ones are
    copied to the compute dtype, the experts are cast one expert at a time) plus one
    batch of activations.

    Args:
        ckpt: the source checkpoint.
        input_ids: int64 ``[N, S]`` calibration tokens.
        batch_size: samples per forward.
        compute_dtype: dtype of the forward. ``None`` (the checkpoint dtype, bf16)
            reproduces the bf16 model bit for bit, so amaxes equal modelopt's own CPU
            calibration; ``torch.float32`` keeps activations in fp32 (about 6x faster
            on CPUs without bf16 matrix units; amaxes differ at bf16 rounding level).
        device: where the layer forward runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``; see
            :func:`calibration_device`). The hidden states stay in host RAM and go to the
            device one batch at a time; the layer's weights go once per layer.
        kv_cache: also record each attention's key and value amax (:func:`record_kv_amax`),
            for the FP8 KV cache scales.

    Attributes:
        seconds: wall seconds spent in :meth:`run_layer` so far (forwards and transfers);
            with ``tokens`` (``N * S``) the cost per layer and per token.

    Raises:
        CheckpointError: the config cannot be turned into a transformers Gemma 4 config.
    """

    def __init__(self, ckpt: Checkpoint, input_ids: torch.Tensor, *, batch_size: int = 8,
                 compute_dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 kv_cache: bool = False):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(ckpt.root)
        except Exception as e:  # transformers raises many types for bad configs
            raise CheckpointError(f"{ckpt.root / 'config.json'}: transformers cannot build a config: {e}") from e
        self.config = config.get_text_config()
        self.config._attn_implementation = "sdpa"
        max_pos = getattr(self.config, "max_position_embeddings", None)
        if max_pos and input_ids.shape[1] > max_pos:
            raise G4Error(f"--calib-seq-len {input_ids.shape[1]} exceeds the model's max_position_embeddings {max_pos}")
        self.ckpt = ckpt
        self.batch_size = batch_size
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.dtype = compute_dtype or ckpt.tensors[ckpt.prefix + "embed_tokens.weight"].dtype
        self.hidden = self._embed(input_ids).to(self.dtype)
        self.tokens = input_ids.numel()
        self.seconds = 0.0
        probe = torch.zeros(1, input_ids.shape[1], self.config.hidden_size, dtype=self.dtype, device=self.device)
        self._positions = PositionBuilder(self.config).positions(probe)  # every sample starts at position 0

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.ckpt.get_rows(self.ckpt.prefix + "embed_tokens.weight", input_ids)
        # Gemma4TextScaledWordEmbedding: the scale is cast to the weight dtype (bf16(sqrt(2816)) = 53.0).
        scale = torch.tensor(embed_scale(self.config.hidden_size, rows.dtype), dtype=rows.dtype)
        return rows * scale

    @torch.no_grad()
    def run_layer(self, layer: int, weights: dict[str, torch.Tensor],
                  on_batch: Callable[[int, int], None] | None = None,
                  hessians: LayerHessians | None = None) -> dict[str, torch.Tensor]:
        """Calibrate layer ``layer`` and advance the hidden states past it.

        Args:
            layer: decoder layer index.
            weights: ``{canonical suffix: tensor}`` of every tensor of the layer
                (e.g. ``"self_attn.q_proj.weight"``, ``"experts.gate_up_proj"``).
            on_batch: called after each batch of samples with ``(samples done, samples)``
                (a progress bar's phase counter).
            hessians: when given, filled with the ``sum x^T x`` of every linear's inputs
                (:class:`LayerHessians`, on the CPU), from the source model's activations.

        Returns:
            ``{module suffix: float32 [] amax}`` for ``self_attn.{q,k,v,o}_proj``,
            ``mlp.{gate,up,down}_proj``, ``experts.gate_up_proj``, ``experts.down_proj``; with
            ``kv_cache`` also ``self_attn.k_bmm`` and ``self_attn.v_bmm`` (:func:`record_kv_amax`).
        """
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

        t0 = time.perf_counter()
        with torch.device("meta"):
            module = Gemma4TextDecoderLayer(self.config, layer)
        weights = {k: v if k in (EXPERT_GATE_UP, EXPERT_DOWN) else v.to(self.dtype) for k, v in weights.items()}
        module.load_state_dict(weights, strict=True, assign=True)
        module.to(self.device).eval()
        stats: dict[str, torch.Tensor] = {}
        hooks = []
        for name, sub in module.named_modules():
            if isinstance(sub, nn.Linear) and name in _DENSE_MODULES:
                hooks.append(sub.register_forward_pre_hook(lambda m, args, key=name: _record_max(stats, key, args[0])))
                if hessians is not None and _HESSIAN_KEY[name] == name:
                    hooks.append(sub.register_forward_pre_hook(
                        lambda m, args, key=name: hessians.add_dense(key, args[0])))
        if hessians is None:
            module.experts.forward = experts_forward_with_input_hook(
                module.experts, lambda kind, x: _record_max(stats, kind, x))
        else:
            n_exp = weights[EXPERT_GATE_UP].shape[0]
            module.experts.forward = experts_forward_with_input_hook(
                module.experts, lambda kind, x, e: hessians.add_expert(kind, _record_max(stats, kind, x), e, n_exp),
                with_expert=True)
        if self.kv_cache:
            hooks.append(record_kv_amax(module.self_attn, stats))
        layer_type = self.config.layer_types[layer]
        position_embeddings, mask = self._positions.rope[layer_type], self._positions.masks[layer_type]
        try:
            for start in range(0, self.hidden.shape[0], self.batch_size):
                batch = self.hidden[start : start + self.batch_size].to(self.device)
                self.hidden[start : start + self.batch_size] = module(
                    batch, None, shared_kv_states={}, position_embeddings=position_embeddings,
                    attention_mask=mask, position_ids=self._positions.ids,
                ).to(self.hidden.device)
                if on_batch is not None:
                    on_batch(min(start + self.batch_size, self.hidden.shape[0]), self.hidden.shape[0])
        finally:
            for h in hooks:
                h.remove()
            del module.experts.forward  # the closure refers to the module: break the cycle now
        if not torch.isfinite(self.hidden).all():
            raise CheckpointError(f"{self.ckpt.root}: calibration activations are not finite after layer {layer}")
        stats = {k: v.cpu() for k, v in stats.items()}
        if hessians is not None:
            hessians.sums = {k: v.cpu() for k, v in hessians.sums.items()}
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        log.info("layer %d: calibrated on %d tokens (%s) in %.2f s, %.1f us per token", layer, self.tokens,
                 self.device, seconds, seconds / max(self.tokens, 1) * 1e6)
        return stats

    @torch.no_grad()
    def final_norm_hessian(self, norm_weight: torch.Tensor) -> torch.Tensor:
        """``sum x^T x`` (fp32 ``[H, H]``, on the CPU) of the final norm's output over every
        calibration token: the input of the lm_head (``Gemma4TextModel.norm``, transformers'
        ``Gemma4RMSNorm`` with ``rms_norm_eps``, in the compute dtype; the logit soft-capping
        comes after the head). Call after :meth:`run_layer` of the last layer.

        Args:
            norm_weight: the final norm's ``[H]`` weight (``norm.weight``).
        """
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        norm = Gemma4RMSNorm(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.weight.data = norm_weight.to(self.device, self.dtype)
        hs = LayerHessians()
        for start in range(0, self.hidden.shape[0], self.batch_size):
            hs.add_dense("lm_head", norm(self.hidden[start : start + self.batch_size].to(self.device)))
        return hs.sums["lm_head"].cpu()


def load_tokenizer(root: Path, *, without: str):
    """The checkpoint's tokenizer, for calibration.

    Raises:
        CheckpointError: it cannot be loaded; the message ends with ``without``, how to convert
            without calibration (e.g. ``"use --weight-only"``).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(root)
    except Exception as e:  # many exception types for a missing/broken tokenizer
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{root}: calibration needs the checkpoint's tokenizer and it cannot be "
                              f"loaded ({type(e).__name__}: {first_line}); add tokenizer files or {without}") from e


def make_calibrator(ckpt: Checkpoint, calib_data, *, samples: int, seq_len: int, batch_size: int, dtype: str,
                    device: torch.device, kv_cache: bool = False, without: str) -> tuple["LayerCalibrator", int]:
    """The layer calibrator over the calibration text (``calib_data``, None: the packaged set),
    ``samples`` x ``seq_len`` tokens in the compute dtype named ``dtype`` (a key of
    :data:`CALIB_DTYPES`), and its number of tokens.

    Raises:
        CheckpointError: no loadable tokenizer (``without``: see :func:`load_tokenizer`), or a
            config transformers cannot build.
        G4Error: unreadable or too short calibration text, an unknown ``dtype``.
    """
    if dtype not in CALIB_DTYPES:
        raise G4Error(f"unknown calibration dtype {dtype!r}; choose one of {', '.join(CALIB_DTYPES)}")
    tokenizer = load_tokenizer(ckpt.root, without=without)
    ids = make_calibration_ids(tokenizer, read_calibration_texts(calib_data, tokenizer), samples=samples,
                               seq_len=seq_len)
    calibrator = LayerCalibrator(ckpt, ids, batch_size=batch_size, compute_dtype=CALIB_DTYPES[dtype], device=device,
                                 kv_cache=kv_cache)
    return calibrator, ids.numel()


def calibration_device(name: str) -> torch.device:
    """The device calibration runs on: ``"auto"`` is the first CUDA device where torch sees
    one, else the CPU; ``"cpu"``, ``"cuda"`` and ``"cuda:N"`` as torch names them.

    The CPU path is the reference: on a CUDA device the amaxes differ only by the device's
    matmul rounding (``tests/convert/test_calibrate_device.py`` compares them).

    Raises:
        G4Error: an unknown name, or a CUDA device that torch does not see here.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise G4Error(f"--calib-device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise G4Error(f"--calib-device {name!r}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise G4Error(f"--calib-device {name}: torch sees {count} CUDA device(s) here"
                          + ("" if count else f" (torch {torch.__version__})"))
    return device
