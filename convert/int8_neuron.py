"""``g4convert int8-neuron``: int8 per-channel shards per TP rank for AWS Neuron (NxD).

Output (layout, sharding rules and manifest: ``g4.exporters.neuron_int8``):

- ``weights/tp{r}_sharded_checkpoint.safetensors`` for each rank r, keyed and shaped as the
  ``state_dict()`` of g4's NxDI class at that rank: int8 experts, dense
  MLP and vocabulary-sharded lm_head (built from ``embed_tokens`` when tied, from the
  source's own ``lm_head.weight`` when ``tie_word_embeddings`` is false) with fp32
  per-channel scales; bf16 attention (int8 with ``quantize_attention``), router, norms, the
  device embedding shard and NxD's rank indices;
- ``embed_tokens.safetensors``: the unscaled bf16 embedding table for the host lookup;
- ``manifest.json``: TP degree, layout, dtypes, what was quantized, ``embed_scale`` as the
  runtime must apply it, KV-head placement, source file hashes and the memory plan;
- ``config.json`` (SRC's in the release form, :func:`g4.core.gemma4.release_config`),
  tokenizer, chat template and generation config copied from SRC.

Weights (``algorithm``): ``max`` rounds each weight to nearest under NxD's per-channel scale,
NxD's own quantizer bit for bit; ``gptq`` keeps those scales and chooses the codes by GPTQ
(:func:`g4.quantizers.gptq.gptq_int8`) with each quantized linear's input Hessian from the
layer-streamed calibration pass of :mod:`g4.convert.calibrate` (as ``g4convert nvfp4 --algorithm
gptq``: each expert from the tokens routed to it, :meth:`LayerHessians.expert_batches` for experts
too few tokens reach, which keep ``max``'s codes); the lm_head's Hessian is that of the final
norm's output (:meth:`LayerCalibrator.final_norm_hessian`).

Streaming as in the NVFP4 path: one tensor in RAM at a time (``gptq``: one decoder layer and its
Hessians); output written into a temporary directory and renamed into place when complete.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from g4.convert.calibrate import (
    CALIB_BATCH_SIZE,
    CALIB_DEVICE,
    CALIB_DTYPE,
    CALIB_SAMPLES,
    CALIB_SEQ_LEN,
    GPTQ_MIN_TOKENS,
    LayerCalibrator,
    LayerHessians,
    calibration_device,
    make_calibrator,
)
from g4.convert.card import write_model_card
from g4.convert.nvfp4 import peak_rss_bytes
from g4.convert.pipeline import READ_AHEAD_BYTES, BackgroundHashes, SourceRelease, overlapped
from g4.convert.plan import plan_memory
from g4.convert.sources import checked_sources
from g4.core.checkpoint import CONFIG_NAME, Checkpoint, copy_side_files
from g4.core.errors import G4Error
from g4.core.gemma4 import EXPERT_DOWN, EXPERT_GATE_UP, LM_HEAD, VISION_PREFIXES, release_config, tower_of
from g4.core.progress import progress_bar
from g4.core.sizes import format_bytes
from g4.exporters.neuron_int8 import (
    EMBED_FILE,
    EMBED_TENSOR,
    KEPT_DTYPE,
    WEIGHTS_DIR,
    Entry,
    Geometry,
    Manifest,
    RankMajor,
    RankMajorInt8,
    entry_specs,
    geometry,
    layer_entries,
    layer_prefix,
    model_entries,
    rank_file,
    rank_major_layout,
    serving_max_context_length,
    serving_max_length,
    shard,
)
from g4.exporters.output_dir import atomic_output_dir
from g4.exporters.safetensors_writer import ShardedSafetensorsWriter, TensorSpec
from g4.quantizers import gptq, int8

log = logging.getLogger(__name__)

# --algorithm: how the int8 codes are chosen (the scales are NxD's absmax / 127 for both).
# max: round to nearest, NxD's own quantizer bit for bit (the default); gptq: GPTQ on the
# calibration inputs. The names are g4convert nvfp4's.
ALGORITHMS = ("max", "gptq")
DEFAULT_ALGORITHM = "max"  # the bytes int8-neuron wrote before --algorithm existed
# What manifest.json says of each (quantization.algorithm_detail).
ALGORITHM_DETAIL = {
    "max": "round to nearest: clamp(round_half_even(w * fp32(1 / scale)), -128, 127), NxD's quantizer bit for bit",
    "gptq": f"GPTQ (Frantar et al. 2022) under the same scales on each linear's calibration input Hessian "
            f"sum x^T x: each expert from the tokens routed to it (fewer than {GPTQ_MIN_TOKENS}: round to nearest), "
            f"the lm_head from the final norm's output; {gptq.DEFAULT_DAMP:.0%} damping",
}
# The lm_head's key in the LayerHessians of the model tensors (its input: the final norm's output).
_HEAD = "lm_head"


@dataclass
class Int8Report:
    """What an int8-neuron conversion did. Bytes, seconds."""

    out: Path
    tp: int
    bytes_in: int
    bytes_per_rank: list[int]
    host_embed_bytes: int
    seconds: float
    peak_rss_bytes: int
    algorithm: str = DEFAULT_ALGORITHM
    calibration_tokens: int = 0
    calibration_seconds: float = 0.0

    def summary(self) -> str:
        """One line; sizes in the unit that shows them (:func:`~g4.core.sizes.format_bytes`)."""
        ranks = ", ".join(format_bytes(b) for b in self.bytes_per_rank)
        calib = (f"; {self.algorithm} on {self.calibration_tokens} calibration tokens (calibration "
                 f"{self.calibration_seconds:.1f} s)" if self.calibration_tokens else "")
        return (f"{self.out}: TP={self.tp}; per-rank weights {ranks}; host embedding "
                f"{format_bytes(self.host_embed_bytes)}; source {format_bytes(self.bytes_in)}; {self.seconds:.1f} s; "
                f"peak RSS {self.peak_rss_bytes / 2**30:.2f} GiB" + calib)


def _layer_jobs(ckpt: Checkpoint, g: Geometry, quantize_attention: bool):
    smap = checked_sources(ckpt)
    layers = []
    for ls in smap.layers:
        entries = layer_entries(has_v=g.has_v[ls.index], quantize_attention=quantize_attention)
        layers.append((ls.index, ls.tensors, entries))
    model_sources = {"norm.weight": ckpt.prefix + "norm.weight", "embed_tokens.weight": ckpt.prefix + "embed_tokens.weight"}
    if smap.lm_head:
        model_sources[LM_HEAD] = smap.lm_head
    model = [(e, None if e.source is None else model_sources[e.source]) for e in model_entries(tied=g.arch.tied)]
    return smap, layers, model


def source_rank_specs(ckpt: Checkpoint, tp: int, *, quantize_attention: bool = False) -> list[TensorSpec]:
    """The tensors (name, dtype, per-rank shape) :func:`convert_int8_neuron` would write into each
    rank file of ``ckpt`` at TP ``tp``, from the source's headers alone (no weight is read).

    Raises:
        G4Error: a TP degree the model cannot be split over, or a source the converter refuses.
    """
    g = geometry(ckpt.config, tp)
    _, layers, model = _layer_jobs(ckpt, g, quantize_attention)
    return rank_specs(ckpt, g, layers, model)


def rank_specs(ckpt: Checkpoint, g: Geometry, layers, model) -> list[TensorSpec]:
    """Tensors of one rank file in write order (identical names and shapes on every rank)."""
    specs: list[TensorSpec] = []
    for L, src, entries in layers:
        for e in entries:
            specs += _specs(ckpt, e, None if e.source is None else src[e.source], layer_prefix(L), g, L)
    for e, name in model:
        specs += _specs(ckpt, e, name, "", g, None)
    return specs


def _specs(ckpt: Checkpoint, e: Entry, name: str | None, prefix: str, g: Geometry, layer: int | None):
    if name is None:  # a rank index: no source tensor
        return entry_specs(e, prefix, (), torch.int32, g, layer)
    info = ckpt.tensors[name]
    return entry_specs(e, prefix, info.shape, KEPT_DTYPE, g, layer)  # kept tensors in the layout's dtype


def convert_int8_neuron(
    src: str | Path,
    out: str | Path,
    *,
    tp: int = 2,
    quantize_attention: bool = False,
    target: str | None = "inf2.xlarge",
    force: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    seq_len: int | None = None,
    max_context_length: int | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    calib_data: str | Path | None = None,
    calib_samples: int = CALIB_SAMPLES,
    calib_seq_len: int = CALIB_SEQ_LEN,
    calib_batch_size: int = CALIB_BATCH_SIZE,
    calib_dtype: str = CALIB_DTYPE,
    calib_device: str = CALIB_DEVICE,
) -> Int8Report:
    """Convert a Gemma 4 MoE checkpoint to per-rank int8 NxD shards.

    Args:
        src: Hugging Face checkpoint directory (multimodal or text-only layout; the
            vision tower is not exported: this is for text serving).
        out: output directory (atomic: temp dir beside it, renamed when complete).
        tp: tensor-parallel degree (ranks = NeuronCores).
        quantize_attention: also int8 q/k/v/o (default bf16).
        target: Neuron instance the memory plan is checked against (``None``: no check).
        force: write even when the plan says the result does not fit ``target``.
        overwrite: replace an existing ``out`` once the new result is complete.
        seq_len: tokens (prompt plus reply) the result is compiled and served for on Neuron;
            the memory plan sizes the KV cache for it and the manifest records it with its
            bucket ladders (``None``: ``DEFAULT_MAX_LENGTH`` capped at ``max_position_embeddings``,
            :func:`g4.exporters.neuron_int8.serving_max_length`).
        max_context_length: longest prompt (tokens) it encodes in one context-encoding call, NxDI's
            ``max_context_length`` (its largest context-encoding bucket; token generation runs to
            ``seq_len``); the plan counts that bucket's attention (``None``:
            ``DEFAULT_MAX_CONTEXT_LENGTH`` capped at ``seq_len``,
            :func:`g4.exporters.neuron_int8.serving_max_context_length`).
        algorithm: one of :data:`ALGORITHMS`: ``max`` (round to nearest, NxD's quantizer bit for
            bit) or ``gptq`` (GPTQ codes under the same scales, on the calibration inputs of every
            quantized linear, the lm_head included; see the module docstring).
        calib_data, calib_samples, calib_seq_len, calib_batch_size, calib_dtype, calib_device:
            ``gptq`` only: the calibration text and pass, as for
            :func:`g4.convert.nvfp4.convert_nvfp4` (ignored by ``max``, which does not calibrate).

    Returns:
        :class:`Int8Report`.

    Raises:
        G4Error (CheckpointError, MappingError, ExportError): bad source, a TP degree the
            model cannot use, a result that does not fit ``target`` without ``force``,
            an existing ``out``, an unknown ``algorithm``; for ``gptq`` also a bad calibration
            device, text or tokenizer.
    """
    t0 = time.perf_counter()
    _check_algorithm(algorithm)
    device = calibration_device(calib_device) if algorithm == "gptq" else None
    # without calibration the chat template is compiled (transformers imported, 1.3 s here) while
    # the first layer is read
    ckpt = Checkpoint(src, source=True, defer_template_check=algorithm != "gptq")
    g = geometry(ckpt.config, tp)
    max_length = serving_max_length(seq_len, g.arch.max_positions)
    prompt_length = serving_max_context_length(max_context_length, max_length)
    plan = _checked_plan(ckpt, tp, target, quantize_attention, force, max_length, prompt_length)
    smap, layers, model = _layer_jobs(ckpt, g, quantize_attention)
    embed_name = ckpt.prefix + "embed_tokens.weight"
    specs = rank_specs(ckpt, g, layers, model)
    bytes_in = sum(i.nbytes for i in ckpt.tensors.values())

    host_bytes = math.prod(ckpt.tensors[embed_name].shape) * KEPT_DTYPE.itemsize
    need = tp * sum(spec.nbytes for spec in specs) + host_bytes
    calibrator, calib_tokens = None, 0
    if algorithm == "gptq":
        calibrator, calib_tokens = make_calibrator(ckpt, calib_data, samples=calib_samples, seq_len=calib_seq_len,
                                                   batch_size=calib_batch_size, dtype=calib_dtype, device=device,
                                                   without="use --algorithm max")
    # the manifest's source hashes, while the weights are written, paced behind the conversion's
    # reads so both use the same pages; each range leaves the page cache once both are done with it
    release = SourceRelease(hashed=True)
    hashes = BackgroundHashes(ckpt.shards, release=release)
    try:
        with atomic_output_dir(Path(out), overwrite=overwrite, sources=[ckpt.root], need_bytes=need) as tmp:
            # the kernels compiled while the first tensors are read, not after
            int8.warm(_kernel_shapes(ckpt, g, layers, model, experts=algorithm == "gptq"))
            with progress_bar(bytes_in, "int8-neuron", enabled=progress) as bar:
                per_rank = _write_weights(tmp, ckpt, g, layers, model, specs, bar, quantize_attention, calibrator,
                                          release)
            ckpt.side_files_checked()
            ckpt.close()
            Manifest.build(
                g, embed_dtype=KEPT_DTYPE, quantize_attention=quantize_attention,
                not_exported=[n.rstrip(".") for n in VISION_PREFIXES if any(tower_of(k) == n for k in smap.model_keep)],
                source={"files": hashes.result(), "prefix": ckpt.prefix},
                memory_plan=plan.to_dict() if plan is not None else None, max_length=max_length,
                max_context_length=prompt_length, algorithm=algorithm, algorithm_detail=ALGORITHM_DETAIL[algorithm],
                calibration_tokens=calib_tokens).write(tmp)
            options = dict(tp=tp, quantize_attention=quantize_attention, target=target, force=force, algorithm=algorithm)
            if algorithm == "gptq":  # what the result depends on; a max result calibrates nothing
                options.update(calib_data=calib_data, calib_samples=calib_samples, calib_seq_len=calib_seq_len,
                               calib_dtype=calib_dtype)
            _finish(tmp, ckpt, out, options)
    finally:
        hashes.close()
        release.close()
    return Int8Report(Path(out), tp, bytes_in, [per_rank] * tp, host_bytes, time.perf_counter() - t0,
                      peak_rss_bytes(), algorithm, calib_tokens, calibrator.seconds if calibrator else 0.0)


def _finish(tmp: Path, ckpt: Checkpoint, out, options: dict) -> None:
    """The result's config (release form), side files and model card (with the result-affecting
    ``options``), beside the weights."""
    (tmp / CONFIG_NAME).write_text(json.dumps(release_config(ckpt.config), indent=2) + "\n")
    copy_side_files(ckpt.root, tmp)
    write_model_card(tmp, "int8-neuron", src=ckpt, out_name=Path(out).name, options=options)  # README.md (hub helper)


def _checked_plan(ckpt: Checkpoint, tp: int, target: str | None, quantize_attention: bool, force: bool,
                  seq_len: int, max_context_length: int):
    """The memory plan for ``target`` at ``seq_len`` tokens and prompts of ``max_context_length``
    (None without a target); a result that does not fit is refused
    unless ``force``, and a host RAM short of what loading needs (the plan's host rows) is warned about.

    Raises:
        G4Error: does not fit ``target`` and not ``force``.
    """
    if target is None:
        return None
    # bucketing as g4serve compiles the result (the manifest's bucket ladder, serve/neuron_backend.py)
    plan = plan_memory(ckpt.config, fmt="int8-neuron", tp=tp, target=target, seq_len=seq_len,
                       attention="int8" if quantize_attention else "bf16", src_dir=ckpt.root, enable_bucketing=True,
                       max_context_length=max_context_length)
    if not plan.fits and not force:
        raise G4Error(f"the int8 result does not fit {target} at TP={tp}: it needs "
                      f"{plan.total_per_rank / 1e9:.2f} GB per rank, a NeuronCore has "
                      f"{plan.device_mem_per_rank / 1e9:.2f} GB; choose a larger target or TP, or pass --force")
    if plan.host_fits is False:
        log.warning("host RAM: loading the result on %s needs %.2f GB (the load's anonymous memory and the "
                    "OS/runtime allowance, g4convert plan), %s has %.2f GB", target, plan.host_ram_need / 1e9,
                    target, plan.host_ram / 1e9)
    return plan


def _check_algorithm(algorithm: str) -> None:
    """Raises G4Error for an ``algorithm`` not in :data:`ALGORITHMS`."""
    if algorithm not in ALGORITHMS:
        raise G4Error(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def save_kernels(src: str | Path, *, tp: int = 2, quantize_attention: bool = False,
                 algorithm: str = DEFAULT_ALGORITHM) -> list[tuple[Path, float | None]]:
    """Package into the per-machine kernel cache (:func:`g4.quantizers.compiled.kernel_cache_dir`)
    the int8 kernels a conversion of ``src`` with these options compiles (:func:`g4.quantizers.int8.save_kernels`:
    one per input width and dtype, and one per experts layout), so that later conversions load
    them in milliseconds.

    Returns:
        ``(package path, compile seconds, or None where the cache had it)`` per kernel.

    Raises:
        G4Error: an unknown algorithm; ``src`` is not a Gemma 4 checkpoint g4 reads or ``tp``
            does not divide its heads.
        ValueError: the kernel cache is off (``G4_KERNEL_CACHE=off``).
        PackageCompileError: AOTInductor cannot compile a kernel here.
        PermissionError: the kernel cache directory is not the user's own or others can write it.
        RuntimeError: a compiled package does not give the eager kernel's bytes.
    """
    _check_algorithm(algorithm)
    ckpt = Checkpoint(src, source=True)
    try:
        g = geometry(ckpt.config, tp)
        _, layers, model = _layer_jobs(ckpt, g, quantize_attention)
        experts = algorithm == "gptq"  # gptq quantizes the experts with int8.quantize, not into a layout
        return int8.save_kernels(_kernel_shapes(ckpt, g, layers, model, experts=experts),
                                 [] if experts else _layout_kernel_shapes(ckpt, g, layers))
    finally:
        ckpt.close()


def _kernel_shapes(ckpt: Checkpoint, g: Geometry, layers, model, *, experts: bool = False
                   ) -> list[tuple[int, int, torch.dtype]]:
    """``(rows, in, dtype)`` of every int8 entry's source tensor that :func:`int8.quantize`'s
    kernel is given, in the order the conversion quantizes them: not the experts', which
    :func:`int8.quantize_to_layout` takes, unless ``experts`` (``--algorithm gptq`` quantizes
    them with :func:`int8.quantize`)."""
    shapes = []
    jobs = [(e, src_names[e.source]) for _, src_names, entries in layers for e in entries if e.source is not None]
    for e, name in jobs + [(e, name) for e, name in model if name is not None]:
        if e.int8 and (experts or rank_major_layout(e, g) is None):
            info = ckpt.tensors[name]
            shapes.append((math.prod(info.shape[:-1]), info.shape[-1], info.dtype))
    return shapes


def _layout_kernel_shapes(ckpt: Checkpoint, g: Geometry, layers) -> list[tuple[RankMajor, tuple[int, ...], torch.dtype]]:
    """``(layout, shape, dtype)`` of every expert tensor :func:`int8.quantize_to_layout` is given."""
    shapes = []
    for _, src_names, entries in layers:
        for e in entries:
            if e.source is not None and (layout := rank_major_layout(e, g)) is not None:
                info = ckpt.tensors[src_names[e.source]]
                shapes.append((layout, tuple(info.shape), info.dtype))
    return shapes


def _layer_reads(src_names: dict[str, str], entries: list[Entry], whole: bool) -> list[str]:
    """Source tensors of one layer in the order the writer takes them: the entries' sources, and
    with ``whole`` (the calibration forward needs the whole layer) any other tensor of the layer."""
    names = [src_names[e.source] for e in entries if e.source is not None]
    return names + [n for n in src_names.values() if n not in names] if whole else names


def _write_weights(tmp: Path, ckpt: Checkpoint, g: Geometry, layers, model, specs: list[TensorSpec], bar,
                   quantize_attention: bool, calibrator: LayerCalibrator | None = None,
                   release: SourceRelease | None = None) -> int:
    """The host embedding table (copied from the source in the background from the start),
    every rank file, one decoder layer in RAM at a time, then the model tensors (device
    embedding shards, final norm, lm_head), all through one overlapped loop: the embedding is
    read while the last layer is quantized, and every tensor is written in the background.
    With ``calibrator`` (``--algorithm gptq``) each layer is read whole, calibrated (its
    Hessians recorded) and then quantized by GPTQ. ``release``: given the source ranges done with
    (:class:`g4.convert.pipeline.SourceRelease`). Returns the bytes of one rank file (all are
    the same size)."""
    embed_name = ckpt.prefix + "embed_tokens.weight"
    (tmp / WEIGHTS_DIR).mkdir()
    writers = [ShardedSafetensorsWriter(tmp, specs, file_name=rank_file(r)) for r in range(g.tp)]
    embed_info = ckpt.tensors[embed_name]
    host = ShardedSafetensorsWriter(tmp, [TensorSpec(EMBED_TENSOR, KEPT_DTYPE, tuple(embed_info.shape))],
                                    file_name=EMBED_FILE)
    model_reads = list(dict.fromkeys(name for _, name in model if name is not None))  # embed_tokens once
    whole = calibrator is not None
    reads = [n for _, src_names, entries in layers for n in _layer_reads(src_names, entries, whole)]
    largest = max((ckpt.tensors[n].nbytes for n in reads), default=0)
    # Read the next tensor while this one is quantized, write in the background: each
    # queue holds about one largest tensor, so RSS stays near 2 x largest + the runtime.
    with overlapped(ckpt, reads + model_reads, write_behind_bytes=max(largest // 2, READ_AHEAD_BYTES),
                    bar=bar, release=release) as (reader, out):
        # the host table is the source's bytes (unscaled: the runtime applies embed_scale): copied
        # first, while the first layer is read and quantized; a source in another dtype than the
        # layout's is cast with the model tensors below
        if embed_info.dtype == KEPT_DTYPE:
            out.copy(host, EMBED_TENSOR, embed_info, release=False)  # read again for the device shards below
        if release is not None:  # every read is planned now (the Prefetcher's and the copy): the hash may start
            release.plan_done()
        for L, src_names, entries in layers:
            w, hessians = {}, None
            if whole:
                bar.set_postfix_str(f"layer {L}: reading", refresh=False)
                by_name = {n: reader.get(n) for n in _layer_reads(src_names, entries, True)}
                w = {s: by_name[n] for s, n in src_names.items()}
                del by_name
                hessians = LayerHessians()
                bar.set_postfix_str(f"layer {L}: calibrating")
                calibrator.run_layer(L, w, hessians=hessians, on_batch=lambda done, n, L=L: bar.set_postfix_str(
                    f"layer {L}: calibrating, {done}/{n} samples"))
            for e in entries:
                if e.source is None:  # a rank index
                    _write_entry(writers, e, None, g, L, layer_prefix(L), out.write)
                    continue
                name = src_names[e.source]
                if not whole:
                    bar.set_postfix_str(f"layer {L}: reading {e.source}", refresh=False)
                t = w.pop(e.source) if whole else reader.get(name)
                bar.set_postfix_str(f"layer {L}: quantizing {e.source}" if e.int8 else f"layer {L}: copying {e.source}")
                _write_entry(writers, e, t, g, L, layer_prefix(L), out.write, hessians)
                del t
                bar.update(ckpt.tensors[name].nbytes)
            # tensors a layer has but no entry reads (none in Gemma 4) still count as done
            rest = sum(ckpt.tensors[n].nbytes for n in src_names.values()) - sum(
                ckpt.tensors[src_names[e.source]].nbytes for e in entries if e.source is not None)
            bar.update(max(rest, 0))
            log.info("layer %d: experts, dense MLP%s -> int8 (%s), sharded over %d ranks", L,
                     " and attention" if quantize_attention else "", "gptq" if whole else "max", g.tp)
            ckpt.side_files_checked()  # the chat template, checked while this layer was read
            del w, hessians
        values: dict[str, torch.Tensor] = {}
        head = None
        for e, name in model:
            if name is not None and name not in values:
                bar.set_postfix_str(f"reading {name}", refresh=False)
                values[name] = reader.get(name)
            if whole and e.key == _HEAD:  # its input: the final norm's output after the last layer
                bar.set_postfix_str("lm_head: calibrating")
                head = LayerHessians()
                head.sums[_HEAD] = calibrator.final_norm_hessian(values[ckpt.prefix + "norm.weight"])
            bar.set_postfix_str(f"quantizing {e.key}" if e.int8 else f"copying {e.key}")
            _write_entry(writers, e, values.get(name), g, None, "", out.write, head)
        if embed_info.dtype != KEPT_DTYPE:
            out.write(host, EMBED_TENSOR, values[embed_name].to(KEPT_DTYPE))
            if name != embed_name and e.key == "lm_head":  # an untied model's own head
                bar.update(ckpt.tensors[name].nbytes)
        del values, head
    for w in (*writers, host):
        w.close()
    bar.update(embed_info.nbytes)
    return writers[0].total_bytes


def _int8_weight(e: Entry, tensor: torch.Tensor, hessians: LayerHessians | None, layer: int | None) -> int8.Int8Weight:
    """``tensor`` (``[out, in]``, experts ``[E, out, in]``) in int8 with NxD's per-channel scales:
    rounded to nearest without ``hessians`` or without a Hessian of its input; otherwise by GPTQ
    (experts: :func:`_gptq_experts`; the lm_head: the model tensors' ``hessians`` under its key)."""
    if hessians is None:
        return int8.quantize(tensor)
    if e.source in (EXPERT_GATE_UP, EXPERT_DOWN):
        return _gptq_experts(tensor, hessians, e.source, layer)
    h = hessians.get(_HEAD if e.key == _HEAD else e.source_module)
    if h is None:
        log.info("%s: no calibration Hessian recorded: max", e.key)
        return int8.quantize(tensor)
    return gptq.gptq_int8(tensor, h)


def _gptq_experts(w: torch.Tensor, hessians: LayerHessians, kind: str, layer: int) -> int8.Int8Weight:
    """GPTQ of every expert ``w[e]`` (``[E, out, in]``) with the Hessian of the tokens routed to it;
    experts :meth:`LayerHessians.expert_batches` leaves out (too few tokens) keep ``max``'s codes.
    The scales are ``max``'s for every expert."""
    res = int8.quantize(w)
    for idx, h in hessians.expert_batches(kind, w.shape[0], layer=layer, fallback="max"):
        res.weight[idx] = gptq.gptq_int8(w[idx], h).weight
    return res


def _write_entry(writers, e: Entry, tensor: torch.Tensor | None, g: Geometry, layer: int | None, prefix: str,
                 write, hessians: LayerHessians | None = None) -> None:
    """Quantize (``e.int8``; by GPTQ where ``hessians`` are given, :func:`_int8_weight`) and shard
    ``tensor`` (None for a rank index); ``write(writer, name, t)`` each rank's pieces (views where
    the rule allows; ``BackgroundWriter.write``)."""
    layout = rank_major_layout(e, g) if hessians is None else None
    if layout is not None:  # the experts' codes quantized straight into every rank's layout, one pass
        q = int8.quantize_to_layout(tensor, layout)
        value = RankMajorInt8(q.weight, q.scale)
    else:
        value = _int8_weight(e, tensor, hessians, layer) if e.int8 else tensor if tensor is None else tensor.to(KEPT_DTYPE)
    names = e.names(prefix)
    for r, w in enumerate(writers):
        for n, t in zip(names, shard(e, value, g, layer, r)):
            write(w, n, t)
