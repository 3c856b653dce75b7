"""CPU reference: rebuild a converted NVFP4 checkpoint as a transformers Gemma 4 model and
compare it with its source (greedy token agreement, KL of next-token distributions).

The converted weights are dequantized (``e2m1 * fp8 block scale * weight_scale_2``) to
the compute dtype, the per-expert linears are re-fused into transformers' 3-D
``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj [E, H, I]``,
and the embedding stays inside ``Gemma4TextScaledWordEmbedding`` (so its
``sqrt(hidden_size)`` scale is applied as in the source). With ``act_quant`` every
quantized linear's input is also fake-quantized to NVFP4 against its ``input_scale``
(W4A4 as served on Blackwell; Hopper serves weight-only).

:func:`load_source_model` / :func:`load_converted_model` hold a whole model in RAM (the
``g4serve`` CPU engine and tests use them); :func:`g4.convert.verify.verify_nvfp4` never does:
it runs source and result one decoder layer at a time (:mod:`g4.convert.stream`), so the 26B
verifies in about one layer of RAM beside the head.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from g4.convert.calibrate import experts_forward_with_input_hook
from g4.core.checkpoint import CONFIG_NAME, Checkpoint, read_json_object
from g4.core.errors import CheckpointError
from g4.core.gemma4 import LM_HEAD, is_tied, split_gate_up
from g4.core.prompt import chat_ids
from g4.exporters.modelopt_nvfp4 import output_layout
from g4.exporters.nvfp4_names import Role
from g4.quantizers import nvfp4 as q


def load_nvfp4_as_hf(out_dir: str | Path | Checkpoint, dtype: torch.dtype = torch.bfloat16, *, prefix: str = "",
                     on_read: Callable[[int], None] | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Dequantize an NVFP4 checkpoint (or the part of it under ``prefix``) into a
    transformers-layout state dict.

    Args:
        out_dir: the result directory, or it already opened.
        dtype: dtype of the dequantized weights.
        prefix: read only the tensors whose names start with it, e.g. one decoder layer's
            ``model.language_model.layers.5.`` (the layer-streaming reference,
            :mod:`g4.convert.stream`); ``""``: the whole checkpoint.
        on_read: called with each tensor's stored bytes once it is read and dequantized (a
            progress bar over the stored bytes under ``prefix``; a tensor the model does not
            take, such as a KV cache scale, is counted without being read).

    Returns:
        (state dict with dequantized ``dtype`` weights and fused 3-D experts, every other
        tensor as stored; ``{module name: input_scale}`` of quantized modules, with
        experts keyed ``<layer>.experts.gate_up_proj`` / ``<layer>.experts.down_proj``),
        keys being full checkpoint names.
    """
    ckpt = out_dir if isinstance(out_dir, Checkpoint) else Checkpoint(out_dir)
    layout = output_layout(ckpt)  # name -> what it is and where it goes in transformers' model
    present = {name for name in ckpt.tensors if name.startswith(prefix)}
    done = on_read or (lambda n: None)

    def raw(name: str) -> torch.Tensor:  # read where it is used, so a bar moves as the work does
        tensor = ckpt.get(name)
        done(ckpt.tensors[name].nbytes)
        return tensor

    sd: dict[str, torch.Tensor] = {}
    input_scales: dict[str, torch.Tensor] = {}
    # fused expert tensor -> [E, rows of one expert, in], filled in place as each expert linear is
    # dequantized: a layer's experts are in RAM once, in one allocation per fused tensor (held per
    # expert and stacked afterwards, they were there twice, and the heap left behind by a few
    # hundred medium-sized pieces per layer put the eval of a 2-layer synthetic 26B at 7-8 GiB
    # in some runs, 4.2-4.3 GiB in others)
    fused: dict[str, torch.Tensor] = {}
    # fused name -> expert -> {proj: (out_features, in_features)} of its linears present
    parts: dict[str, dict[int, dict[str, tuple[int, int]]]] = {}
    for t in layout.tensors:
        if t.role == Role.WEIGHT and t.linear.expert is not None and t.name in present:
            lin = t.linear
            parts.setdefault(lin.hf_name, {}).setdefault(lin.expert, {})[lin.proj] = (lin.out_features,
                                                                                      lin.in_features)
    shape_of: dict[str, tuple[int, int, int]] = {}  # fused name -> (E, rows of one expert, in_features)
    for name, by_expert in parts.items():
        for e in range(max(by_expert) + 1):
            if by_expert.get(e) != by_expert[0] or set(by_expert[0]) not in ({"gate_proj", "up_proj"}, {"down_proj"}):
                raise CheckpointError(f"{ckpt.root}: {name}: the NVFP4 linears of expert {e} are missing or "
                                      "differ from expert 0's")
        first = by_expert[0].values()
        shape_of[name] = (len(by_expert), sum(o for o, _ in first), next(iter(first))[1])
    # A name the table does not list is passed on as stored, for the load to report.
    sd |= {name: raw(name) for name in sorted(present) if name not in layout.by_name}
    for t in layout.tensors:
        if t.name not in present:
            continue
        if t.role == Role.KEPT:
            sd[t.name] = raw(t.name)
        elif t.role == Role.INPUT_SCALE:
            input_scales[t.linear.input_key] = raw(t.name)
        elif t.role == Role.WEIGHT:
            lin = t.linear
            w = q.dequantize_tensors(raw(t.name), raw(lin.name(Role.WEIGHT_SCALE)), raw(lin.name(Role.WEIGHT_SCALE_2)),
                                     dtype)
            if lin.expert is None:
                sd[lin.hf_name] = w
                continue
            # into transformers' [E, 2I, H] gate_up (its gate and up rows as split_gate_up cuts them) or [E, H, I] down
            if lin.hf_name not in fused:
                fused[lin.hf_name] = torch.empty(shape_of[lin.hf_name], dtype=dtype)
            slot = fused[lin.hf_name][lin.expert]
            if lin.proj != "down_proj":
                slot = split_gate_up(slot)[0 if lin.proj == "gate_proj" else 1]
            slot.copy_(w)
            del w, slot
        elif t.role in (Role.K_SCALE, Role.V_SCALE):  # transformers' model has no KV cache scales
            done(ckpt.tensors[t.name].nbytes)
    return sd | fused, input_scales


def missing_weights(missing: list[str], config: dict) -> list[str]:
    """The weights a transformers load left uninitialised: ``missing`` without ``lm_head.weight``
    when the model is tied (it is ``embed_tokens``), with it when the model is untied."""
    tied = is_tied(config)
    return [k for k in missing if not (tied and k == LM_HEAD)]


def _model_class(config: dict):
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration if config.get("model_type") == "gemma4" else Gemma4ForCausalLM


def empty_model(config, raw_config: dict, dtype: torch.dtype):
    """The transformers model class of ``raw_config`` (config.json as a dict) built from the
    transformers ``config`` in ``dtype``, eval mode, weights to be loaded by the caller.

    Built as ``from_pretrained`` builds (``_from_config(dtype=)``): the RoPE ``inv_freq`` buffers
    stay fp32 as in the source model; ``model.to(bf16)`` would cast them, a RoPE error the source
    does not have.
    """
    return _model_class(raw_config)._from_config(config, dtype=dtype).eval()


def load_source_model(src: Path, dtype: torch.dtype = torch.bfloat16):
    """The source checkpoint as a transformers model (eval mode, eager experts).

    Raises:
        CheckpointError: transformers would leave weights uninitialised (e.g. the
            pre-release ``moe.*`` expert names, which only g4's converter maps).
    """
    src_config = Checkpoint(src, source=True).config
    model, info = _model_class(src_config).from_pretrained(src, dtype=dtype, experts_implementation="eager",
                                                           output_loading_info=True)
    missing = missing_weights(info.get("missing_keys", []), src_config)
    if missing:
        raise CheckpointError(f"{src}: transformers cannot load {len(missing)} source tensor(s) (e.g. {missing[0]}); "
                              "a reference with random weights would be meaningless")
    return model.eval()


def no_input_scales(out_dir: str | Path) -> CheckpointError:
    """The error for W4A4 emulation asked of a weight-only (W4A16) result."""
    return CheckpointError(f"{out_dir}: W4A4 emulation needs input_scale tensors and this result has none "
                           "(weight-only W4A16)")


def load_converted_model(out_dir: str | Path, src: str | Path | None = None, dtype: torch.dtype = torch.bfloat16, *,
                         act_quant: bool = False, on_read: Callable[[int], None] | None = None):
    """The NVFP4 result ``out_dir`` as a transformers Gemma 4 model (eval mode, eager experts)
    whose weights are the dequantized result (:func:`load_nvfp4_as_hf`), in ``dtype``.

    The architecture is built from ``src``'s config.json (the source), or when ``src`` is None
    from OUT's own (its ``quantization_config`` dropped: the weights arrive dequantized).
    ``act_quant``: W4A4 emulation, every quantized input fake-quantized against its
    ``input_scale`` (:func:`install_activation_quant`). ``on_read``: called with the bytes of
    each stored tensor read.

    Raises:
        CheckpointError: the converted tensors do not cover the model exactly, or
            ``act_quant`` for a weight-only (W4A16) result, which has no ``input_scale``.
    """
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    config_dir = Path(src) if src is not None else out_dir
    config = AutoConfig.from_pretrained(config_dir, experts_implementation="eager")
    if hasattr(config, "quantization_config"):  # built as a plain model; weights are dequantized below
        del config.quantization_config
    raw_config = read_json_object(config_dir / CONFIG_NAME)
    model = empty_model(config, raw_config, dtype)
    sd, input_scales = load_nvfp4_as_hf(out_dir, dtype, on_read=on_read)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = missing_weights(missing, raw_config)
    if missing or unexpected:
        raise CheckpointError(f"{out_dir}: converted tensors do not match the model {config_dir / 'config.json'} "
                              f"describes: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    if act_quant:
        if not input_scales:
            raise no_input_scales(out_dir)
        install_activation_quant(model, input_scales)
    return model


def install_activation_quant(model: nn.Module, input_scales: dict[str, torch.Tensor]) -> None:
    """Fake-quantize (NVFP4, dynamic fp8 block scales, static global input_scale) the
    input of every quantized linear and of both expert projections."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    for name, module in model.named_modules():
        if name in input_scales and isinstance(module, nn.Linear):
            scale = input_scales[name]
            module.register_forward_pre_hook(lambda m, args, s=scale: (q.fake_quantize_activation(args[0], s),))
        elif isinstance(module, Gemma4TextExperts) and f"{name}.gate_up_proj" in input_scales:
            scales = {kind: input_scales[f"{name}.{kind.split('.')[1]}"]
                      for kind in ("experts.gate_up_proj", "experts.down_proj")}
            module.forward = experts_forward_with_input_hook(
                module, lambda kind, x, s=scales: q.fake_quantize_activation(x, s[kind]))


def chat_prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """``text`` as one user turn of the chat template, ready for generation: int64 ``[1, S]``
    (:func:`g4.core.prompt.chat_ids`)."""
    return torch.tensor([chat_ids(tokenizer, [{"role": "user", "content": text}])])


def compare_logprobs(pairs) -> dict[str, float]:
    """Token agreement and KL of next-token distributions, the figures ``verify`` reports.

    Args:
        pairs: per sequence ``(lp, lq, reply_start)``: fp32 ``[S-1, V]`` log-probabilities of
            the source and of the converted model at every position but the last (position
            ``t`` predicts token ``t + 1``), and the first position that predicts a
            continuation token (prompt length - 1).

    Returns:
        ``{"positions", "token_agreement", "mean_kl"}`` over continuation positions and
        ``{"all_positions", "all_token_agreement", "all_mean_kl"}`` over every position;
        agreement in [0, 1] (argmax equal), KL(source || converted) in nats.
    """
    sums = {"n": 0, "agree": 0, "kl": 0.0, "all_n": 0, "all_agree": 0, "all_kl": 0.0}
    for lp, lq, start in pairs:
        kl = (lp.exp() * (lp - lq)).sum(-1)
        agree = lp.argmax(-1) == lq.argmax(-1)
        reply = slice(start, None)
        sums["n"] += kl[reply].numel()
        sums["agree"] += agree[reply].sum().item()
        sums["kl"] += kl[reply].sum().item()
        sums["all_n"] += kl.numel()
        sums["all_agree"] += agree.sum().item()
        sums["all_kl"] += kl.sum().item()
    n, all_n = max(sums["n"], 1), max(sums["all_n"], 1)
    return {"positions": sums["n"], "token_agreement": sums["agree"] / n, "mean_kl": sums["kl"] / n,
            "all_positions": sums["all_n"], "all_token_agreement": sums["all_agree"] / all_n,
            "all_mean_kl": sums["all_kl"] / all_n}


@torch.no_grad()
def compare_models(src_model, q_model, tokenizer, prompts, *, max_new_tokens: int = 16) -> dict[str, float]:
    """Teacher-force two whole transformers models on each chat-formatted prompt plus the
    source's greedy continuation and compare next-token distributions
    (:func:`compare_logprobs`). ``verify`` computes the same figures layer by layer
    (:func:`g4.convert.stream.compare_streamed`); this is for models held in RAM.
    """
    def pairs():
        for prompt in prompts:
            ids = chat_prompt_ids(tokenizer, prompt)
            seq = src_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            lp = torch.log_softmax(src_model(seq).logits[0, :-1].float(), -1)
            lq = torch.log_softmax(q_model(seq).logits[0, :-1].float(), -1)
            yield lp, lq, ids.shape[1] - 1

    return compare_logprobs(pairs())
