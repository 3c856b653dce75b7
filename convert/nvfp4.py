"""``g4convert nvfp4``: stream a Gemma 4 MoE checkpoint into a modelopt NVFP4 checkpoint.

Pipeline: validate the source (headers, index, config, name table) -> plan every output
tensor -> copy the kept model tensors' bytes to their places, checked for NaN/Inf as they
are copied (in the background) -> per
decoder layer: read its tensors, calibrate input amax through it, unfuse and quantize its
experts and dense linears, write them at their places, free -> write metadata -> check the
result -> rename into place.

Peak host RAM is about one decoder layer in the source dtype (plus calibration
activations), never the model. Output format: NVIDIA Model Optimizer's Hugging Face export
(NVIDIA/Model-Optimizer ``modelopt/torch/export/unified_export_hf.py``) as vLLM loads it;
details in ``g4.exporters.modelopt_nvfp4``.
"""

from __future__ import annotations

import functools
import logging
import resource
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.convert.calibrate import (
    CALIB_BATCH_SIZE,
    CALIB_DEVICE,
    CALIB_DTYPE,
    CALIB_DTYPES,
    CALIB_SAMPLES,
    CALIB_SEQ_LEN,
    LayerCalibrator,
    LayerHessians,
    calibration_device,
    make_calibrator,
)
from g4.convert.card import write_model_card
from g4.convert.pipeline import DiskReadahead, InOrder, SourceRelease, overlapped
from g4.convert.sources import checked_sources
from g4.core.checkpoint import Checkpoint, copy_side_files
from g4.core.errors import CheckpointError, ExportError
from g4.core.gemma4 import LM_HEAD, split_gate_up
from g4.core.progress import progress_bar
from g4.core.sizes import format_bytes, parse_size
from g4.exporters import modelopt_nvfp4 as meta
from g4.exporters.nvfp4_names import (
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    KV_AMAX_KEYS,
    PRESETS,
    LayerLayout,
    Linear,
    Nvfp4Layout,
    Part,
    Role,
)
from g4.exporters.output_dir import atomic_output_dir
from g4.exporters.safetensors_writer import ShardedSafetensorsWriter, TensorSpec
from g4.quantizers import gptq, nvfp4 as q

log = logging.getLogger(__name__)

# --algorithm: how the weights are quantized (modelopt's names); max is modelopt's default, bit for bit.
ALGORITHMS = ("max", "mse", "gptq")
# g4's default: the best mean KLD on the quality test model among the algorithms that convert the
# 26B-A4B on a CPU within about twice max's time (gptq measures better but takes hours per the 26B
# on CPUs: README, g4convert nvfp4, "Algorithms"); its bytes differ from modelopt's default export,
# so tests that compare with modelopt pass algorithm="max".
DEFAULT_ALGORITHM = "mse"


@dataclass
class ConvertReport:
    """What a conversion did. Sizes in bytes, time in seconds, RSS in bytes."""

    out: Path
    linears_quantized: int
    tensors_kept: int
    params_quantized: int
    quantized_bytes: int
    bytes_in: int
    bytes_out: int
    seconds: float
    peak_rss_bytes: int
    calibration_tokens: int
    calibration_seconds: float = 0.0
    layers: int = 0

    @property
    def bits_per_quantized_weight(self) -> float:
        """Stored bits per quantized parameter (E2M1 + fp8 block scales + fp32 scalars): ~4.5."""
        return self.quantized_bytes * 8 / max(self.params_quantized, 1)

    def summary(self) -> str:
        """One line: counts, bits per weight, sizes (in the unit that shows them), seconds, peak
        RSS, and the calibration tokens and cost, or ``no calibration`` (W4A16 without GPTQ)."""
        calibration = (f"{self.calibration_tokens} calibration tokens" if self.calibration_tokens
                       else "no calibration (weight-only)")
        return (f"{self.out}: {self.linears_quantized} linears NVFP4, {self.tensors_kept} kept; "
                f"{self.bits_per_quantized_weight:.3f} bits/weight on quantized linears; "
                f"{format_bytes(self.bytes_in)} -> {format_bytes(self.bytes_out)} "
                f"({self.bytes_out / max(self.bytes_in, 1):.3f}x); {self.seconds:.1f} s; "
                f"peak RSS {self.peak_rss_bytes / 2**30:.2f} GiB; {calibration}" + self.calibration_cost())

    def calibration_cost(self) -> str:
        """``"; calibration S s (s per layer, us per token per layer)"``, or ``""`` for W4A16."""
        if not self.calibration_tokens or not self.layers:
            return ""
        per_layer = self.calibration_seconds / self.layers
        return (f"; calibration {self.calibration_seconds:.1f} s ({per_layer:.2f} s per layer, "
                f"{per_layer / self.calibration_tokens * 1e6:.1f} us per token per layer)")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- planning


def _check_in_features(name: str, in_features: int) -> None:
    if in_features % q.BLOCK_SIZE:
        raise CheckpointError(f"tensor {name}: input dimension {in_features} is not a multiple of "
                              f"the NVFP4 block size {q.BLOCK_SIZE}; use a preset that leaves it bf16")


def source_layout(ckpt: Checkpoint, parts: frozenset[Part], *, act_quant: bool, kv_cache: bool = False) -> Nvfp4Layout:
    """Map every source tensor, check each layer's structure and expand the output table, before
    anything is written.

    Raises:
        MappingError: unmapped or missing tensors, a v_proj on a k_eq_v layer.
        CheckpointError: shapes that disagree with the config, or a quantized linear whose input
            dimension is not a multiple of the NVFP4 block (16).
    """
    smap = checked_sources(ckpt)
    layout = Nvfp4Layout.build(
        ckpt.arch, prefix=ckpt.prefix, parts=parts, act_quant=act_quant,
        layer_sources=[ls.tensors for ls in smap.layers], model_sources=smap.model_keep, lm_head=smap.lm_head,
        dtypes={n: i.dtype for n, i in ckpt.tensors.items()}, shapes={n: i.shape for n, i in ckpt.tensors.items()},
        kv_cache=kv_cache)
    for lin in layout.linears:
        _check_in_features(lin.source, lin.in_features)
    return layout


def output_specs(layout: Nvfp4Layout) -> list[TensorSpec]:
    """Every output tensor (name, dtype, shape) in the order :func:`convert_nvfp4` produces it."""
    return [TensorSpec(t.name, t.dtype, t.shape) for t in layout.tensors]


# --------------------------------------------------------------------------- producing


def _input_scale(amax: dict[str, torch.Tensor], keys: tuple[str, ...], fallback: torch.Tensor,
                 layer: int) -> torch.Tensor:
    """Shared ``input_scale`` of a group: max input amax over its members / 2688.

    A group whose calibration amax is zero (no signal reached it) falls back to the
    layer's largest recorded input amax, logged, so no written scale is ever 0.
    """
    vals = [amax[k] for k in keys if k in amax]
    a = torch.stack(vals).amax() if vals else torch.tensor(0.0)
    if not a > 0:
        log.warning("layer %d: %s saw no non-zero calibration input; using the layer max %.4g",
                    layer, "/".join(keys), fallback.item())
        a = fallback
    return q.global_scale_from_amax(a)


def _produce_layer(lay: LayerLayout, w: dict[str, torch.Tensor], amax: dict[str, torch.Tensor] | None,
                   algorithm: str = "max", hessians: LayerHessians | None = None,
                   weight_amax: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Output tensors of one layer (``w``: source name -> tensor, each looked up once, so a
    :class:`g4.convert.pipeline.InOrder` can hand it out as it is read), in the table's order.
    ``weight_amax``: source name -> ``max(|w|)`` (per expert for the experts) where known already
    (:meth:`g4.convert.pipeline.Prefetcher.amax`), else computed here."""
    for t in lay.kept:
        yield t.name, w[t.source]
    kv_amax = {k: v for k, v in (amax or {}).items() if k in KV_AMAX_KEYS.values()}
    input_amax = [v for k, v in (amax or {}).items() if k not in kv_amax]
    layer_max = torch.stack(input_amax).amax() if input_amax else torch.tensor(1.0)
    if not layer_max > 0:
        layer_max = torch.tensor(1.0)
    for group in lay.groups:
        weights = [w[lin.source] for lin in group]
        shared_g = q.global_scale_from_amax(torch.stack([q.weight_amax(x) for x in weights]).amax())
        keys = tuple(lin.key for lin in group)
        shared_in = _input_scale(amax, keys, layer_max, lay.index) if amax is not None else None
        for lin, x in zip(group, weights):
            h = hessians.get(lin.key) if hessians is not None else None
            if algorithm == "gptq" and h is not None:
                qw = gptq.gptq_nvfp4(x, h, shared_g)
            else:
                qw = q.quantize(x, weight_scale_2=shared_g, method="mse" if algorithm == "gptq" else algorithm)
            yield from _named(lin, (qw.weight, qw.weight_scale, qw.weight_scale_2, shared_in))
    if not lay.experts:
        yield from _kv_scales(lay, kv_amax)
        return
    gate, _, down = lay.experts[0]
    in_gu = _input_scale(amax, (gate.key,), layer_max, lay.index) if amax is not None else None
    in_dn = _input_scale(amax, (down.key,), layer_max, lay.index) if amax is not None else None
    # All experts in one kernel call each; gate and up share the global scale of the whole
    # fused gate_up_proj[e] (vLLM uses one), so the split comes after quantization.
    if algorithm == "gptq":
        qgu = _gptq_experts(w[gate.source], hessians, EXPERT_GATE_UP, lay.index)
        qdn = _gptq_experts(w[down.source], hessians, EXPERT_DOWN, lay.index)
    else:
        known = weight_amax or {}
        qgu = q.quantize_experts(w[gate.source], method=algorithm, amax=known.get(gate.source))
        qdn = q.quantize_experts(w[down.source], method=algorithm, amax=known.get(down.source))
    for e, (gate, up, down) in enumerate(lay.experts):
        gate_w, up_w = split_gate_up(qgu.weight[e])
        gate_s, up_s = split_gate_up(qgu.weight_scale[e])
        yield from _named(gate, (gate_w, gate_s, qgu.weight_scale_2[e].clone(), in_gu))
        yield from _named(up, (up_w, up_s, qgu.weight_scale_2[e].clone(), in_gu))
        yield from _named(down, (qdn.weight[e], qdn.weight_scale[e], qdn.weight_scale_2[e].clone(), in_dn))
    yield from _kv_scales(lay, kv_amax)


def _kv_scales(lay: LayerLayout, kv_amax: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The layer's FP8 KV cache scales (``amax / 448``, :func:`g4.quantizers.nvfp4.kv_cache_scale_from_amax`).

    Raises:
        ExportError: an amax that is not finite and > 0 (no calibration token reached the
            attention, or a dead projection): vLLM would divide by it.
    """
    for t in lay.kv_scales:
        a = kv_amax.get(KV_AMAX_KEYS[t.role])
        if a is None or not (torch.isfinite(a) and a > 0):
            raise ExportError(f"layer {lay.index}: calibration gave {t.role.value} amax "
                              f"{None if a is None else a.item()} for {t.name}; it must be finite and > 0")
        yield t.name, q.kv_cache_scale_from_amax(a)


def _gptq_experts(w: torch.Tensor, hessians: LayerHessians, kind: str, layer: int) -> q.NVFP4Weight:
    """GPTQ of every expert ``w[e]`` (``[E, out, in]``) with the Hessian of the tokens routed to
    it; the global scales are :func:`q.quantize_experts`'s; experts that fewer than
    :data:`g4.convert.calibrate.GPTQ_MIN_TOKENS` (token, expert) pairs reached get mse block scales
    (:meth:`LayerHessians.expert_batches`)."""
    res = q.quantize_experts(w, method="mse")
    for idx, h in hessians.expert_batches(kind, w.shape[0], layer=layer, fallback="mse"):
        r = gptq.gptq_nvfp4(w[idx], h, res.weight_scale_2[idx])
        res.weight[idx], res.weight_scale[idx] = r.weight, r.weight_scale
    return res


def _named(lin: Linear, values: tuple) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each of ``lin``'s roles (weight, weight_scale, weight_scale_2[, input_scale])."""
    return zip(lin.names, values)


# --------------------------------------------------------------------------- entry point


def convert_nvfp4(
    src: str | Path,
    out: str | Path,
    *,
    preset: str = "default",
    algorithm: str = DEFAULT_ALGORITHM,
    weight_only: bool = False,
    calib_data: str | Path | None = None,
    calib_samples: int = CALIB_SAMPLES,
    calib_seq_len: int = CALIB_SEQ_LEN,
    calib_batch_size: int = CALIB_BATCH_SIZE,
    calib_dtype: str = CALIB_DTYPE,
    calib_device: str = CALIB_DEVICE,
    kv_cache_dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool = True,
) -> ConvertReport:
    """Convert a Gemma 4 MoE checkpoint directory to a modelopt NVFP4 checkpoint.

    Args:
        src: Hugging Face checkpoint directory (single or sharded safetensors;
            multimodal ``model.language_model.*`` or text-only ``model.*`` layout).
        out: output directory; created atomically (temp dir beside it, renamed when complete).
        preset: ``default`` (experts + dense MLP + attention), ``mlp-only`` (experts +
            dense MLP) or ``experts-only``; routers, norms, embeddings, towers and lm_head
            always stay in the source dtype.
        algorithm: how the weights' block scales (and codes) are chosen, one of :data:`ALGORITHMS`:
            ``max`` (modelopt's default, bit-identical with its export) or ``mse`` (g4's default,
            :data:`DEFAULT_ALGORITHM`: per block the E4M3 scale of least squared weight error,
            modelopt's ``mse`` with ``fp8_scale_sweep``) or
            ``gptq`` (GPTQ with per-block mse scales, Hessians of every linear's inputs from the
            calibration pass, which then also runs for ``weight_only``; see :mod:`g4.quantizers.gptq`).
        weight_only: W4A16: no calibration, no ``input_scale`` tensors, config without
            ``input_activations`` (case P05). Default W4A4 with calibrated ``input_scale``.
        calib_data: text or jsonl file; ``None`` uses the packaged default set.
        calib_samples / calib_seq_len: number and length (tokens) of calibration samples.
        calib_batch_size: samples per layer forward during calibration.
        calib_dtype: ``"float32"`` (fast on CPUs; amaxes within bf16 rounding of a bf16
            run) or ``"bfloat16"`` (the bf16 model bit for bit, as modelopt calibrates it).
        calib_device: ``"auto"`` (a CUDA device where torch sees one, else the CPU),
            ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (:func:`g4.convert.calibrate.calibration_device`).
        kv_cache_dtype: ``"auto"`` (no KV cache scales: vLLM keeps the KV cache in the model
            dtype, or uses 1.0 with ``--kv-cache-dtype fp8``) or ``"fp8"``: modelopt's FP8 KV
            cache export, a calibrated float32 ``[]`` ``k_scale`` / ``v_scale`` (amax / 448 of
            the keys / values as the attention function sees them,
            :func:`g4.convert.calibrate.record_kv_amax`) per decoder layer under
            ``…self_attn.k_proj.k_scale`` / ``…self_attn.v_proj.v_scale`` (k_eq_v layers too,
            which have no v_proj), and ``kv_cache_quant_algo: "FP8"`` in both metadata files.
            Needs calibration, so also with ``weight_only``.
        max_shard_size: shard data limit, e.g. ``"5GB"`` (10**9) or ``"4GiB"`` (2**30).
        overwrite: replace an existing ``out`` (only once the new one is complete).
        progress: show a tqdm bar in source bytes.

    Returns:
        :class:`ConvertReport`.

    Raises:
        CheckpointError, MappingError: bad source (named file/tensor); nothing is left behind
            (a bad kept tensor may be found once OUT's temporary directory is made: it is removed).
        ExportError: ``out`` exists without ``overwrite``, or the result fails its checks.
    """
    t0 = time.perf_counter()
    _check_preset_and_algorithm(preset, algorithm)
    if calib_dtype not in CALIB_DTYPES:
        raise ExportError(f"unknown calibration dtype {calib_dtype!r}; choose one of {', '.join(CALIB_DTYPES)}")
    if kv_cache_dtype not in meta.KV_CACHE_DTYPES:
        raise ExportError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of {', '.join(meta.KV_CACHE_DTYPES)}")
    kv_cache = kv_cache_dtype == "fp8"
    parts = PRESETS[preset]
    calibrate = not weight_only or kv_cache or algorithm == "gptq"
    device = calibration_device(calib_device) if calibrate else None
    max_shard_bytes = parse_size(max_shard_size)
    # without calibration (minutes before the first layer ends) the chat template is compiled
    # (transformers imported, 1.3 s here) while the first layer is read
    ckpt = Checkpoint(src, source=True, defer_template_check=not calibrate)
    layout = source_layout(ckpt, parts, act_quant=not weight_only, kv_cache=kv_cache)
    specs = output_specs(layout)

    _log_tensor_kinds(ckpt, layout)
    calibrator, calib_tokens = None, 0
    if calibrate:
        calibrator, calib_tokens = make_calibrator(ckpt, calib_data, samples=calib_samples, seq_len=calib_seq_len,
                                                   batch_size=calib_batch_size, dtype=calib_dtype, device=device,
                                                   kv_cache=kv_cache, without="use --weight-only")

    bytes_in = sum(i.nbytes for i in ckpt.tensors.values())
    if calibrate:  # the kept tensors checked before a layer's calibration (minutes), not beside it
        _check_kept(ckpt, layout)
    need = sum(spec.nbytes for spec in specs)
    with atomic_output_dir(Path(out), overwrite=overwrite, sources=[ckpt.root], need_bytes=need) as tmp:
        # the kernels compiled while the kept tensors and the first layer are read, not after
        q.warm(_kernel_shapes(ckpt, layout), "mse" if algorithm == "gptq" else algorithm)
        writer = ShardedSafetensorsWriter(tmp, specs, max_shard_bytes=max_shard_bytes)
        with progress_bar(bytes_in, "nvfp4", enabled=progress) as bar:
            n_quant, params_quant, quant_bytes = _write_tensors(writer, ckpt, layout, calibrator, bar, algorithm,
                                                                act_quant=not weight_only, check_kept=not calibrate)
        ckpt.side_files_checked()
        writer.close()
        ckpt.close()
        copy_side_files(ckpt.root, tmp)
        meta.write_metadata(tmp, ckpt.config, excludes=layout.exclude_modules(), weight_only=weight_only,
                            kv_cache=kv_cache)
        meta.check_export(tmp, label=Path(out), layout=layout)
        write_model_card(tmp, "nvfp4", src=ckpt, out_name=Path(out).name, options=dict(  # README.md (hub helper)
            preset=preset, algorithm=algorithm, weight_only=weight_only, calib_data=calib_data,
            calib_samples=calib_samples, calib_seq_len=calib_seq_len, calib_dtype=calib_dtype,
            kv_cache_dtype=kv_cache_dtype, max_shard_size=max_shard_size), layout=layout)
        bytes_out = writer.total_bytes
    per_linear = 3 if weight_only else 4
    kv_scales = sum(len(lay.kv_scales) for lay in layout.layers)
    return ConvertReport(Path(out), n_quant, len(specs) - per_linear * n_quant - kv_scales, params_quant, quant_bytes,
                         bytes_in, bytes_out, time.perf_counter() - t0, peak_rss_bytes(), calib_tokens,
                         calibrator.seconds if calibrator else 0.0, len(layout.layers))


def _write_tensors(writer: ShardedSafetensorsWriter, ckpt: Checkpoint, layout: Nvfp4Layout,
                   calibrator: LayerCalibrator | None, bar, algorithm: str = "max", *,
                   act_quant: bool = True, check_kept: bool = True) -> tuple[int, int, int]:
    """Every output tensor in the table's order, one decoder layer in RAM at a time.
    ``check_kept``: the kept model tensors are checked for NaN/Inf as they are copied (else the
    caller has checked them, :func:`_check_kept`).

    Returns:
        (quantized linears, quantized parameters, bytes of their codes and scales).
    """
    n_quant = params_quant = quant_bytes = 0
    reads = [n for lay in layout.layers for n in production_reads(lay)]
    # Read the next layer while this one is calibrated and quantized, write in the background.
    # The reader holds at most one tensor (or READ_AHEAD_BYTES of small ones) that this layer
    # has not taken yet, so RSS is about one layer + the next layer's largest tensor.
    # the source's pages leave the page cache once quantized or copied (SourceRelease)
    with SourceRelease() as release, overlapped(ckpt, reads, bar=bar, release=release) as (reader, out):
        # The kept model tensors (embeddings, towers, final norm) are the source's bytes at their
        # places in OUT: copied first, while the layers are read and quantized, each piece checked
        # for NaN/Inf as it is copied (a bad one fails the loop's next write, in the first layer;
        # checked before the loop, the 26B-A4B's 1.5 GB of them held up its start by 1.7-2.9 s
        # on the 2-core machine here)
        for t in layout.model:
            check = functools.partial(ckpt.check_finite_part, t.source) if check_kept else None
            out.copy(writer, t.name, ckpt.tensors[t.source], check=check)
        for lay in layout.layers:
            layer_bytes = sum(ckpt.tensors[n].nbytes for n in lay.sources.values())
            layer_params = params_in_layer(lay)
            bar.set_postfix_str(f"layer {lay.index}: reading", refresh=False)
            # each tensor taken from the reader when the layer's production first needs it, in the
            # order it is read (production_reads): without calibration the dense linears are
            # quantized while the experts are read, and each expert tensor while the next is read
            # (each handed out once: a source tensor is freed once quantized or written)
            layer = InOrder(reader, production_reads(lay))
            by_source = layer
            amax = hessians = None
            if calibrator is not None:  # the calibration forward needs the whole layer first
                w = {s: layer[n] for s, n in lay.sources.items()}
                bar.set_postfix_str(f"layer {lay.index}: calibrating")
                hessians = LayerHessians() if algorithm == "gptq" else None
                amax = calibrator.run_layer(lay.index, w, on_batch=lambda done, n, L=lay.index: bar.set_postfix_str(
                    f"layer {L}: calibrating, {done}/{n} samples"), hessians=hessians)
                if not act_quant:  # W4A16: no input scales; the KV cache amaxes (if any) stay
                    amax = {k: v for k, v in amax.items() if k in KV_AMAX_KEYS.values()} or None
                by_source = {lay.sources[s]: t for s, t in w.items()}
                del w
            bar.set_postfix_str(f"layer {lay.index}: quantizing")
            done = 0
            # per-expert amax of the experts, from the reading thread's NaN/Inf check
            src_amax = layer.amaxes
            for name, t in _produce_layer(lay, by_source, amax, algorithm, hessians, src_amax):
                out.write(writer, name, t)
                role = layout.by_name[name].role
                if layout.by_name[name].linear is not None:  # not kept, not a KV cache scale
                    quant_bytes += t.numel() * t.dtype.itemsize
                if role == Role.WEIGHT:  # move the bar by the source share of each quantized linear
                    n_quant += 1
                    params_quant += t.numel() * 2
                    step = layer_bytes * t.numel() * 2 // max(layer_params, 1)
                    bar.update(min(step, layer_bytes - done))
                    done += min(step, layer_bytes - done)
            layer.take_rest()  # a source no output reads (none in Gemma 4): the reader's order stays
            bar.update(layer_bytes - done)
            log.info("layer %d: %d dense groups + %d experts x 3 -> NVFP4, %d tensors kept",
                     lay.index, len(lay.groups), len(lay.experts), len(lay.kept))
            ckpt.side_files_checked()  # the chat template, checked while this layer was read
            del layer, by_source, hessians, src_amax
    bar.update(sum(ckpt.tensors[t.source].nbytes for t in layout.model))
    return n_quant, params_quant, quant_bytes


def _check_kept(ckpt: Checkpoint, layout: Nvfp4Layout) -> None:
    """Refuse NaN/Inf in the kept model tensors (:meth:`Checkpoint.get_finite`), read in order
    with the disk asked for them ahead (a cold 1.5 GB embedding otherwise comes in
    page-fault-sized reads).

    Raises:
        CheckpointError: naming the file and tensor.
    """
    ahead = DiskReadahead(ckpt, [t.source for t in layout.model])
    try:
        for i, t in enumerate(layout.model):
            ahead.reading(i)
            ckpt.get_finite(t.source)
            ckpt.close()
    finally:
        ahead.close()


def production_reads(lay: LayerLayout) -> list[str]:
    """The source tensors of a layer in the order :func:`_produce_layer` first uses them (kept
    tensors, dense groups, the experts' gate_up, then down), then any other source of the layer:
    the order the conversion reads them in, so that each is taken as it arrives."""
    order = [t.source for t in lay.kept] + [lin.source for g in lay.groups for lin in g]
    if lay.experts:
        order += [lay.experts[0][0].source, lay.experts[0][2].source]
    return list(dict.fromkeys(order + list(lay.sources.values())))


def _check_preset_and_algorithm(preset: str, algorithm: str) -> None:
    """Raises ExportError for a ``preset`` or ``algorithm`` not in :data:`PRESETS` / :data:`ALGORITHMS`."""
    if preset not in PRESETS:
        raise ExportError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if algorithm not in ALGORITHMS:
        raise ExportError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def save_kernels(src: str | Path, *, preset: str = "default", algorithm: str = DEFAULT_ALGORITHM
                 ) -> list[tuple[Path, float | None]]:
    """Package into the per-machine kernel cache (:func:`g4.quantizers.compiled.kernel_cache_dir`)
    the NVFP4 kernels a conversion of ``src`` with ``preset`` and ``algorithm`` compiles, so that
    later conversions load them in milliseconds instead of compiling them (seconds per process).

    Returns:
        ``(package path, compile seconds, or None where the cache had it)`` per kernel.

    Raises:
        ExportError: an unknown preset or algorithm.
        CheckpointError: ``src`` is not a Gemma 4 checkpoint g4 reads.
        ValueError: the kernel cache is off (``G4_KERNEL_CACHE=off``).
        PackageCompileError: AOTInductor cannot compile a kernel here.
        PermissionError: the kernel cache directory is not the user's own or others can write it.
        RuntimeError: a compiled package does not give the eager kernel's bytes.
    """
    _check_preset_and_algorithm(preset, algorithm)
    ckpt = Checkpoint(src, source=True)
    try:
        layout = source_layout(ckpt, PRESETS[preset], act_quant=False, kv_cache=False)
        return q.save_kernels(_kernel_shapes(ckpt, layout), "mse" if algorithm == "gptq" else algorithm)
    finally:
        ckpt.close()


def _kernel_shapes(ckpt: Checkpoint, layout: Nvfp4Layout) -> list[tuple[int, int, torch.dtype]]:
    """``(out, in, dtype)`` of every 2-D weight the NVFP4 kernel is given (a dense linear, one
    expert of an experts tensor), in the order the layer loop quantizes them."""
    shapes = []
    for lay in layout.layers:
        for group in lay.groups:
            shapes += [(lin.out_features, lin.in_features, ckpt.tensors[lin.source].dtype) for lin in group]
        if lay.experts:
            for lin in (lay.experts[0][0], lay.experts[0][2]):  # gate (the fused gate_up), down
                info = ckpt.tensors[lin.source]
                shapes.append((*info.shape[-2:], info.dtype))
    return shapes


def params_in_layer(lay: LayerLayout) -> int:
    """Parameters of a layer's quantized linears (dense groups and experts): the unit by which
    the progress bar moves through a layer."""
    return sum(lin.out_features * lin.in_features for lin in lay.linears)


def _log_tensor_kinds(ckpt: Checkpoint, layout: Nvfp4Layout) -> None:
    """One log line per tensor kind and shape: how many, and what is written for them."""
    act = " + input_scale" if layout.act_quant else ""
    kinds: Counter = Counter()
    for lay in layout.layers:
        for group in lay.groups:
            for lin in group:
                label = "/".join(g.key.rpartition(".")[2] for g in group)
                kinds[(lin.key, ckpt.tensors[lin.source].dtype, (lin.out_features, lin.in_features), label)] += 1
        if lay.experts:
            gate, _, down = lay.experts[0]
            for lin in (gate, down):
                info = ckpt.tensors[lin.source]
                kinds[(lin.key, info.dtype, info.shape, "")] += 1
    for (kind, dtype, shape, group), n in kinds.items():
        if kind == EXPERT_GATE_UP:
            what = f"{shape[0]} x gate_proj + up_proj nvfp4 [{shape[1] // 2}, {shape[2]}] (one weight_scale_2 per expert)"
        elif kind == EXPERT_DOWN:
            what = f"{shape[0]} x down_proj nvfp4 [{shape[1]}, {shape[2]}]"
        else:
            what = f"nvfp4 [{shape[0]}, {shape[1]}] (weight_scale_2 shared by {group})"
        log.info("%-22s x%-3d %s %-18s -> %s%s", kind, n, str(dtype).removeprefix("torch."), list(shape), what, act)
    if layout.layers:
        log.info("%-22s x%-3d kept as stored: %s", "layer tensors", len(layout.layers),
                 ", ".join(t.name[len(layout.layers[0].prefix):] for t in layout.layers[0].kept))
    log.info("%-22s      kept as stored: %d tensors (embed_tokens, final norm, towers)", "model tensors",
             sum(t.name != LM_HEAD for t in layout.model))
