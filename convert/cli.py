"""``g4convert``: command-line front end (click). Each command is a thin layer over a
public function; errors the user can act on print one line and exit with status 2."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click

from g4.convert.calibrate import (
    CALIB_BATCH_SIZE,
    CALIB_DEVICE,
    CALIB_DTYPE,
    CALIB_DTYPES,
    CALIB_SAMPLES,
    CALIB_SEQ_LEN,
    calibration_device,
    check_text_file,
)
from g4.convert.card import check_repo_id, set_base_model
from g4.convert.evaluate import eval_device, evaluate, summary
from g4.convert.int8_neuron import (
    ALGORITHMS as INT8_ALGORITHMS,
    DEFAULT_ALGORITHM as INT8_DEFAULT_ALGORITHM,
    convert_int8_neuron,
)
from g4.convert.nvfp4 import ALGORITHMS, DEFAULT_ALGORITHM, convert_nvfp4
from g4.convert.options import (
    COUNT,
    FRACTION,
    SEED,
    SHARD_SIZE,
    ByteSize,
    OneLineUsageGroup,
    act_quant_option,
    configure_output,
    is_quiet,
    min_agreement_option,
    verbosity_options,
)
from g4.convert.plan import (
    ATTENTIONS,
    EMBEDDINGS,
    FORMATS,
    LM_HEADS,
    NEURON_TARGETS,
    apply_result_shape,
    load_source,
    plan_memory,
)
from g4.convert.push import echo_report, hub_token, push_result
from g4.convert.resolve import EMBEDDED, quiet_http_logs, resolve_source, source_name
from g4.convert.synth import write_synthetic
from g4.convert.verify import verify_nvfp4
from g4.core.checkpoint import SRC_FORMS
from g4.core.errors import G4Error, OptionError, exit_on_user_error, install_signal_handlers
from g4.core.sizes import parse_size
from g4.exporters.formats import check_result
from g4.exporters.neuron_int8 import DEFAULT_MAX_CONTEXT_LENGTH, DEFAULT_MAX_LENGTH
from g4.exporters.output_dir import refuse_existing


def _default_out(src: str, suffix: str) -> Path:
    return Path(f"{source_name(src)}-{suffix}")




# --- Hub publishing on the conversion commands (convert/push.py) ---
def _hub_options(fn):
    fn = click.option("--base-model", help="Hub repo id of SRC for the model card's base_model, when g4 cannot "
                                           "tell it from SRC (config _name_or_path, HF cache path).")(fn)
    fn = click.option("--private", is_flag=True, help="With --push-to-hub: create the repo private.")(fn)
    fn = click.option("--push-to-hub", metavar="REPO_ID",
                      help="After a successful conversion, publish OUT to this Hub repo (see `g4convert push`).")(fn)
    return fn


def _hub_preflight(push_to_hub: str | None, base_model: str | None) -> None:
    """Fail before a long conversion when the push could not happen (bad ids, no token)."""
    if base_model:
        check_repo_id(base_model, what="--base-model")
    if push_to_hub:
        check_repo_id(push_to_hub)
        hub_token()


def _hub_after(out: Path, push_to_hub: str | None, private: bool, base_model: str | None) -> None:
    if base_model and not push_to_hub:
        set_base_model(out, base_model)
    if push_to_hub:
        quiet_http_logs()
        echo_report(push_result(out, push_to_hub, private=private, base_model=base_model), out)
# --- end of Hub publishing ---


# --- Calibration options of the commands that calibrate (nvfp4; int8-neuron --algorithm gptq) ---
_CALIB_OPTIONS = ("calib_data", "calib_samples", "calib_seq_len", "calib_batch_size", "calib_dtype", "calib_device")


def _calibration_options(fn):
    """``--calib-data``, ``--calib-samples``, ``--calib-seq-len``, ``--calib-batch-size``,
    ``--calib-dtype``, ``--calib-device`` (defaults: :mod:`g4.convert.calibrate`)."""
    for option in reversed((
        click.option("--calib-data", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Calibration text: .txt (documents separated by blank lines) or .jsonl with 'text' or "
                          "'messages' per line; other suffixes are refused."),
        click.option("--calib-samples", type=COUNT, default=CALIB_SAMPLES, show_default=True),
        click.option("--calib-seq-len", type=click.IntRange(min=8), default=CALIB_SEQ_LEN, show_default=True,
                     help="Tokens per sample."),
        click.option("--calib-batch-size", type=COUNT, default=CALIB_BATCH_SIZE, show_default=True),
        click.option("--calib-dtype", type=click.Choice(list(CALIB_DTYPES)), default=CALIB_DTYPE, show_default=True,
                     help="Calibration forward dtype: float32 is 3-6x faster on CPUs without bf16 matrix units; "
                          "bfloat16 reproduces the bf16 model (and modelopt's own CPU calibration) bit for bit."),
        click.option("--calib-device", default=CALIB_DEVICE, show_default=True,
                     help="Where calibration runs: auto (a CUDA GPU where torch sees one, else the CPU), cpu, cuda, "
                          "cuda:N."),
    )):
        fn = option(fn)
    return fn


def _check_calibration(ctx: click.Context, calibrates: bool, why: str, what_calibrates: str) -> None:
    """Refuse calibration options given to a run that does not calibrate (``why`` it does not,
    ``what_calibrates``: the options that would), and a bad ``--calib-device`` before SRC is fetched."""
    if not calibrates:
        if any(ctx.get_parameter_source(o).name != "DEFAULT" for o in _CALIB_OPTIONS):
            flags = " / ".join("--" + o.replace("_", "-") for o in _CALIB_OPTIONS)
            raise G4Error(f"{why} does not calibrate: drop {flags} (or add {what_calibrates})")
        return

    calibration_device(ctx.params["calib_device"])  # a bad device is an error before SRC is fetched
    if ctx.params.get("calib_data"):
        check_text_file(ctx.params["calib_data"])
# --- end of calibration options ---


@click.group(cls=OneLineUsageGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="g4", prog_name="g4convert")
@verbosity_options
def main() -> None:
    """Shrink Gemma 4 MoE checkpoints and check that the result still answers right.

    \b
    Examples:
      g4convert nvfp4                         # the embedded tiny Gemma 4 -> ./gemma4-tiny-nvfp4
      g4convert nvfp4 ./gemma-4-26B-A4B-it ./gemma-4-26B-A4B-it-NVFP4
      g4convert nvfp4 google/gemma-4-26B-A4B-it   # Hub repo id -> ./gemma-4-26B-A4B-it-nvfp4
      g4convert verify ./gemma4-tiny-nvfp4 --against embedded
      g4convert int8-neuron embedded --tp 2     # -> ./gemma4-tiny-int8-neuron-tp2
      g4convert plan gemma-4-26B-A4B --format int8-neuron --tp 2 --target inf2.xlarge
      g4convert synth --like gemma-4-26B-A4B --layers 2 ./synth-26b
      g4convert kernels ./synth-26b          # compile the quantization kernels once per machine
    """
    install_signal_handlers()  # clean up partial outputs on kill as on Ctrl-C (exit 143); signals recorded
    configure_output(logging.INFO)  # -q / -v given after the subcommand apply when it parses them


@main.command()
@verbosity_options
@click.argument("src", default=EMBEDDED)
@click.argument("out", required=False, type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(["default", "mlp-only", "experts-only"]), default="default",
              show_default=True, help="What is quantized: experts+MLP+attention, experts+MLP, or experts only.")
@click.option("--algorithm", type=click.Choice(ALGORITHMS), default=DEFAULT_ALGORITHM, show_default=True,
              help="Weight quantization: max (modelopt's default, bit-identical with its export), mse (per "
                   "16-element block the E4M3 scale of least squared weight error, modelopt's mse with fp8 sweep) "
                   "or gptq (GPTQ on each linear's calibration inputs, mse block scales; calibrates even with "
                   "--weight-only).")
@click.option("--weight-only", is_flag=True, help="W4A16: no calibration, no input_scale tensors.")
@_calibration_options
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="fp8: also calibrate and write modelopt's FP8 KV cache scales (k_scale / v_scale per layer, "
                   "kv_cache_quant_algo FP8) for `vllm serve --kv-cache-dtype fp8`; auto: none.")
@click.option("--max-shard-size", type=SHARD_SIZE, default="5GB", show_default=True,
              help="Largest shard: GB = 10**9 bytes, GiB = 2**30; at least 1MB (smaller shards only multiply "
                   "files). A tensor larger than this gets a shard of its own, as in transformers.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT once the new result is complete.")
@_hub_options
@click.pass_context
@exit_on_user_error
def nvfp4(ctx, src, out, preset, algorithm, weight_only, calib_data, calib_samples, calib_seq_len,
          calib_batch_size, calib_dtype, calib_device, kv_cache_dtype, max_shard_size, overwrite, push_to_hub,
          private, base_model):
    """Convert SRC (a checkpoint directory, 'embedded', or a Hub repo id owner/name[@revision])
    to a modelopt NVFP4 checkpoint in OUT (default: <name of SRC>-nvfp4).

    OUT uses the tensor names every vLLM from 0.19.1 to 0.33 loads unpatched
    (`vllm serve OUT --quantization modelopt`); a GPU load has not been run by this project yet.
    """
    _hub_preflight(push_to_hub, base_model)

    # calibration runs for W4A4, for FP8 KV cache scales and for GPTQ's Hessians
    _check_calibration(ctx, not weight_only or kv_cache_dtype == "fp8" or algorithm == "gptq", "--weight-only",
                       "--kv-cache-dtype fp8 or --algorithm gptq, which calibrate")
    out = out or _default_out(src, "nvfp4")
    refuse_existing(out, overwrite)  # before SRC is fetched, read or planned
    src_dir = resolve_source(src)
    report = convert_nvfp4(src_dir, out, preset=preset, algorithm=algorithm, weight_only=weight_only,
                           calib_data=calib_data, calib_samples=calib_samples, calib_seq_len=calib_seq_len,
                           calib_batch_size=calib_batch_size, calib_dtype=calib_dtype, calib_device=calib_device,
                           kv_cache_dtype=kv_cache_dtype, max_shard_size=max_shard_size,
                           overwrite=overwrite, progress=not is_quiet())
    click.echo(report.summary())
    _hub_after(out, push_to_hub, private, base_model)


@main.command("int8-neuron")
@verbosity_options
@click.argument("src", default=EMBEDDED)
@click.argument("out", required=False, type=click.Path(path_type=Path))
@click.option("--tp", type=COUNT, default=2, show_default=True,
              help="Tensor-parallel degree (one rank per NeuronCore; at most the --target's cores).")
@click.option("--quantize-attention", is_flag=True, help="Also int8 q/k/v/o (default: bf16, sharded).")
@click.option("--target", default="inf2.xlarge", show_default=True,
              help="Neuron instance the memory plan is checked against (see `g4convert plan`).")
@click.option("--force", is_flag=True, help="Write even if the memory plan says it does not fit the target "
                                           "(more ranks than the target has NeuronCores is always refused).")
@click.option("--seq-len", type=COUNT, default=None,
              help="Tokens (prompt plus reply) to compile and serve for on Neuron; the memory plan sizes the KV "
                   f"cache for it. Default: {DEFAULT_MAX_LENGTH}, at most the model's max_position_embeddings.")
@click.option("--max-context-length", type=COUNT, default=None,
              help="Longest prompt in tokens (NxDI's max_context_length: context-encoding buckets up to it, token "
                   "generation up to --seq-len); the plan counts its attention, which grows with its square. "
                   f"Default: {DEFAULT_MAX_CONTEXT_LENGTH}, at most --seq-len.")
@click.option("--algorithm", type=click.Choice(INT8_ALGORITHMS), default=INT8_DEFAULT_ALGORITHM, show_default=True,
              help="How the int8 codes are chosen under NxD's per-channel scales (absmax/127, the same for both): "
                   "max (round to nearest, NxD's own quantizer bit for bit) or gptq (GPTQ on each quantized linear's "
                   "calibration inputs, lm_head included; calibrates, with the --calib-* options).")
@_calibration_options
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT once the new result is complete.")
@_hub_options
@click.pass_context
@exit_on_user_error
def int8_neuron(ctx, src, out, tp, quantize_attention, target, force, seq_len, max_context_length, algorithm,
                calib_data, calib_samples,
                calib_seq_len, calib_batch_size, calib_dtype, calib_device, overwrite, push_to_hub, private,
                base_model):
    """Write AWS Neuron (NxD) int8 per-channel weights of SRC (a checkpoint directory,
    'embedded', or a Hub repo id owner/name[@revision]) pre-sharded per TP rank into OUT.

    Experts, dense MLP and the tied lm_head (vocabulary-sharded) become int8 with fp32
    per-channel scales; each rank file is the state dict of g4's NxDI class at that rank (with
    its bf16 embedding shard); the whole unscaled table is also written for the host; a manifest
    records the layout, embed_scale and the per-rank memory plan. --algorithm gptq chooses the
    int8 codes by GPTQ on calibration inputs (same scales and layout; calibrates as nvfp4 does).
    """
    _hub_preflight(push_to_hub, base_model)

    _check_calibration(ctx, algorithm == "gptq", "--algorithm max", "--algorithm gptq, which calibrates")
    out = out or _default_out(src, f"int8-neuron-tp{tp}")
    refuse_existing(out, overwrite)  # before SRC is fetched, read or planned
    src_dir = resolve_source(src)
    report = convert_int8_neuron(src_dir, out, tp=tp, quantize_attention=quantize_attention,
                                 target=target, force=force, overwrite=overwrite, progress=not is_quiet(),
                                 seq_len=seq_len, max_context_length=max_context_length, algorithm=algorithm,
                                 calib_data=calib_data,
                                 calib_samples=calib_samples, calib_seq_len=calib_seq_len,
                                 calib_batch_size=calib_batch_size, calib_dtype=calib_dtype,
                                 calib_device=calib_device)
    click.echo(report.summary())
    _hub_after(out, push_to_hub, private, base_model)


@main.command()
@verbosity_options
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--against", "src", default=EMBEDDED, show_default=True, help=f"The source checkpoint: {SRC_FORMS}.")
@click.option("--max-new-tokens", type=COUNT, default=16, show_default=True)
@act_quant_option
@min_agreement_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@exit_on_user_error
def verify(out, src, max_new_tokens, act_quant, min_agreement, as_json):
    """Compare converted OUT against its source on held-out prompts (CPU reference).

    Runs SRC and OUT (dequantized) side by side one decoder layer at a time through
    transformers' Gemma 4 layers, so a model larger than RAM verifies in about one layer of
    memory, and reports per-layer relative error of the hidden states, greedy token agreement
    and mean KL(source || converted) of next-token distributions; for the embedded model
    also whether every fact is still answered. A W4A4 OUT is computed with W4A4 activation
    emulation, as g4serve check does (--no-act-quant: weight-only arithmetic, as Hopper serves
    it). NVFP4 only: an int8-neuron result is checked with g4serve check OUT --against SRC.
    """

    src_dir = resolve_source(src)  # SRC's own errors first, as g4serve check reports them
    check_result(out)  # against its format's table before the reference trusts it
    report = verify_nvfp4(out, src_dir, max_new_tokens=max_new_tokens, act_quant=act_quant,
                          progress=not is_quiet())
    click.echo(report.to_json() if as_json else report.summary())
    failures = report.failures(min_agreement)
    click.echo(f"FAIL: {'; '.join(failures)}" if failures else "PASS", err=as_json)
    if failures:
        sys.exit(1)


@main.command("eval")
@verbosity_options
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--against", "src", default=EMBEDDED, show_default=True, help=f"The source checkpoint: {SRC_FORMS}.")
@click.option("--text", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Held-out text: .txt (documents separated by blank lines) or .jsonl with 'text' or 'messages'. "
                   "Default: the packaged eval_text.jsonl (never used for calibration).")
@click.option("--max-tokens", type=COUNT, default=4096, show_default=True, help="Tokens of the text evaluated at most.")
@click.option("--ctx", "ctx_len", type=click.IntRange(min=4), default=512, show_default=True,
              help="Chunk length in tokens (llama.cpp's -c); the second half of each chunk is scored.")
@act_quant_option
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True,
              help="Compute dtype of both models.")
@click.option("--device", default="auto", show_default=True,
              help="auto (a CUDA GPU where torch sees one, else the CPU), cpu, cuda, cuda:N.")
@click.option("--json", "as_json", is_flag=True, help="Print the report (eval.json) as JSON.")
@click.pass_context
@exit_on_user_error
def eval_(click_ctx, out, src, text, max_tokens, ctx_len, act_quant, dtype, device, as_json):
    """Evaluate OUT against SRC on held-out text with llama.cpp's perplexity --kl-divergence
    statistics: PPL of both and their ratio, KLD(SRC || OUT) mean / median / 90% / 99% / 99.9% /
    max, same top token, RMS of dp. Both models run one decoder layer at a time (a model larger
    than RAM evaluates in about one layer of memory). OUT: an NVFP4 (W4A4 emulated as vLLM on
    Blackwell computes it, or W4A16), int8-neuron or bf16 checkpoint with SRC's config.
    Writes OUT/eval.json; the model card shows it. SRC's final hidden states are kept in
    G4_SOURCE_CACHE (default ~/.cache/g4/source; off: none): a later eval against the same SRC
    and text reads none of SRC's decoder layers.
    """
    import torch

    if text is not None:
        check_text_file(text, "--text")  # before SRC is fetched
    src_dir = resolve_source(src)
    eval_device(device)  # a bad device before any model is read
    report = evaluate(out, src_dir, text=text, max_tokens=max_tokens, ctx=ctx_len, act_quant=act_quant,
                      dtype=getattr(torch, dtype), device=device, progress=not is_quiet())
    click.echo(json.dumps(report, indent=2) if as_json else summary(report) + f"\nwrote {out / 'eval.json'}")


@main.command()
@verbosity_options
@click.argument("src", default=EMBEDDED)
@click.option("--format", "fmt", type=click.Choice(["nvfp4", "int8-neuron"]), default="nvfp4", show_default=True,
              help="The conversion whose kernels to compile.")
@click.option("--algorithm", help=f"The conversion's --algorithm (default: nvfp4 {DEFAULT_ALGORITHM}, "
                                  f"int8-neuron {INT8_DEFAULT_ALGORITHM}).")
@click.option("--preset", type=click.Choice(["default", "mlp-only", "experts-only"]), default="default",
              show_default=True, help="nvfp4's --preset.")
@click.option("--tp", type=COUNT, default=2, show_default=True, help="int8-neuron's --tp.")
@click.option("--quantize-attention", is_flag=True, help="int8-neuron's --quantize-attention.")
@click.pass_context
@exit_on_user_error
def kernels(ctx, src, fmt, algorithm, preset, tp, quantize_attention):
    """Compile once per machine the quantization kernels a conversion of SRC runs, into g4's
    kernel cache ($G4_KERNEL_CACHE, default $XDG_CACHE_HOME/g4/kernels or ~/.cache/g4/kernels):
    later conversions load them in milliseconds instead of compiling them in each process (5-8 s
    here, before the first layer). 7-17 s per kernel here (nvfp4 mse: about 50 s per width);
    nvfp4 max and mse on bf16 build the native C kernel instead (about 0.3 s, with $CC or cc) where
    it builds; tensors under 1M elements run eagerly and need none. The options are the conversion's."""
    from g4.convert import int8_neuron, nvfp4
    from g4.quantizers.compiled import KERNEL_CACHE_ENV, PackageCompileError, kernel_cache_dir

    if kernel_cache_dir() is None:
        raise OptionError(f"the kernel cache is off ({KERNEL_CACHE_ENV}={os.environ[KERNEL_CACHE_ENV]}); "
                          f"set {KERNEL_CACHE_ENV} to a directory")
    # a kernel set is per conversion: an option of another format's conversion names no kernel here
    own = {"nvfp4": ("preset",), "int8-neuron": ("tp", "quantize_attention")}
    other_fmt = "int8-neuron" if fmt == "nvfp4" else "nvfp4"
    given = [p for p in own[other_fmt] if ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise OptionError(f"{flag} is not an option of {fmt}'s conversion (it is --format {other_fmt}'s); "
                          f"{fmt}'s kernels take {', '.join('--' + p.replace('_', '-') for p in own[fmt])}, --algorithm")
    choices = ALGORITHMS if fmt == "nvfp4" else INT8_ALGORITHMS
    if algorithm is not None and algorithm not in choices:
        raise OptionError(f"--algorithm {algorithm!r} is not one of {fmt}'s: {', '.join(choices)}")
    src_dir = resolve_source(src)
    try:
        if fmt == "nvfp4":
            done = nvfp4.save_kernels(src_dir, preset=preset, algorithm=algorithm or DEFAULT_ALGORITHM)
        else:
            done = int8_neuron.save_kernels(src_dir, tp=tp, quantize_attention=quantize_attention,
                                            algorithm=algorithm or INT8_DEFAULT_ALGORITHM)
    except PackageCompileError as e:
        raise G4Error(f"{e}; conversions compile it in their own process instead") from e
    for path, seconds in done:
        click.echo(f"{'in the cache' if seconds is None else f'compiled in {seconds:.1f} s'}: {path}")
    if not done:
        from g4.quantizers.nvfp4 import KERNEL

        click.echo(f"no kernel to compile: every tensor of SRC is under the kernels' {KERNEL.min_elements:,} "
                   "elements (run eagerly)")


@main.command()
@verbosity_options
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--like", "preset", type=click.Choice(["gemma-4-26B-A4B"]), default="gemma-4-26B-A4B",
              show_default=True)
@click.option("--layers", type=COUNT, default=2, show_default=True,
              help="Decoder layers to write (the real model has 30); the last one is full attention.")
@click.option("--no-vision", is_flag=True, help="Text-only layout (model.layers.*) without the vision tower.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--max-shard-size", type=SHARD_SIZE, default="5GB", show_default=True,
              help="Largest shard (at least 1MB).")
@click.option("--overwrite", is_flag=True)
@click.pass_context
@exit_on_user_error
def synth(ctx, out, preset, layers, no_vision, seed, max_shard_size, overwrite):
    """Write a synthetic checkpoint with the real model's key names, shapes and dtypes
    (random bf16 weights) for benchmarks and dry runs on real shapes."""
    path = write_synthetic(out, like=preset, layers=layers, vision=not no_vision, seed=seed,
                           max_shard_size=max_shard_size, overwrite=overwrite, progress=not is_quiet())
    click.echo(f"wrote {path}")


@main.command(context_settings={"help_option_names": ["-h", "--help"]})
@verbosity_options
@click.argument("src", metavar="SRC_OR_CONFIG")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="int8-neuron", show_default=True)
@click.option("--tp", type=COUNT, default=1, show_default=True,
              help="Tensor-parallel degree: one rank per NeuronCore or per GPU.")
@click.option("--target", type=click.Choice(list(NEURON_TARGETS)), help="AWS Neuron instance (16 GiB HBM per core).")
@click.option("--gpu-mem", type=ByteSize(), help="Memory of one GPU instead of --target, with its unit: 80GB "
                                                 "(10**9 bytes) or 128GiB (2**30).")
@click.option("--seq-len", type=COUNT, default=8192, show_default=True,
              help="KV cache tokens per sequence (vLLM's --max-model-len).")
@click.option("--batch", type=COUNT, default=1, show_default=True, help="Sequences in the KV cache.")
@click.option("--max-context-length", type=COUNT, default=None,
              help="Neuron plans: longest prompt in tokens (NxDI's max_context_length, the largest context-encoding "
                   f"bucket), whose attention is counted. Default: {DEFAULT_MAX_CONTEXT_LENGTH}, at most --seq-len.")
@click.option("--max-num-batched-tokens", type=COUNT,
              help="GPU plans: vLLM's --max-num-batched-tokens, which sets what each sliding-window layer "
                   "reserves (window - 1 + this, in blocks). Default: vllm serve's, 8192 for --gpu-mem of 70 GiB "
                   "or more (2048 on an A100), else 2048.")
@click.option("--gpu-memory-utilization", type=FRACTION,
              help="GPU plans: vllm serve's --gpu-memory-utilization, the share of each GPU vLLM may use; "
                   "the fit check is against it. Default: vLLM's, 0.9.")
@click.option("--bucketing", is_flag=True,
              help="Neuron plans: NxDI's enable_bucketing (one graph per bucket of 128, 256, ... up to --seq-len, "
                   "each with its own logits output); default off, as NxDI's NeuronConfig.")
@click.option("--lm-head", type=click.Choice(LM_HEADS),
              help="Default: int8-sharded for int8-neuron, tied to the embedding on a GPU.")
@click.option("--attention", type=click.Choice(ATTENTIONS), help="Default: bf16 (nvfp4 for --format nvfp4).")
@click.option("--embedding", type=click.Choice(EMBEDDINGS), help="Default: device (int8-neuron: always, its rank files hold the shard).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (bytes as integers).")
@click.option("--check", "check", is_flag=True,
              help="Exit 1 when the plan DOES NOT FIT (device or host); without it the exit status is 0 "
                   "whatever the verdict.")
@click.pass_context
@exit_on_user_error
def plan(ctx, src, fmt, tp, target, gpu_mem, seq_len, batch, max_context_length, max_num_batched_tokens,
         gpu_memory_utilization, bucketing, lm_head, attention, embedding, as_json, check):
    """Plan per-rank memory of SRC_OR_CONFIG from its config alone (no weights read).

    SRC_OR_CONFIG: a checkpoint directory, a config.json, a Hub repo id owner/name[@revision]
    (only its config.json is downloaded), gemma-4-26B-A4B, or embedded. A g4 result (NVFP4 or
    int8-neuron) is planned as the result it is: its format, attention and (int8-neuron) TP
    degree and serving length are taken from it.
    Sizes are bytes; GB = 10**9, GiB = 2**30. The KV cache is sized as the engine sizes it:
    vLLM's rule on a GPU, NxDI's on Neuron. With --check the exit status is 1 when something
    does not fit.

    \b
    Examples:
      g4convert plan gemma-4-26B-A4B --target inf2.xlarge --tp 2
      g4convert plan gemma-4-26B-A4B --format nvfp4 --gpu-mem 32GiB --seq-len 32768
      g4convert plan ./gemma-4-26B-A4B-it --format bf16 --gpu-mem 80GB --tp 2 --json
    """

    gpu_mem_bytes = None if gpu_mem is None else parse_size(gpu_mem)
    name, config, directory, shape = load_source(src)
    options = dict(fmt=fmt, tp=tp, seq_len=seq_len, attention=attention, target=target, bucketing=bucketing,
                   max_context_length=max_context_length)
    if shape is not None:
        given = {k for k in options if ctx.get_parameter_source(k).name != "DEFAULT"}
        options = apply_result_shape(src, shape, options, given)
        name = f"{name} ({shape.detail} result)"
    result = plan_memory(config, fmt=options["fmt"], tp=options["tp"], target=options["target"],
                         gpu_mem_bytes=gpu_mem_bytes, seq_len=options["seq_len"], batch=batch, lm_head=lm_head,
                         attention=options["attention"], embedding=embedding, src_dir=directory, model=name,
                         max_num_batched_tokens=max_num_batched_tokens, enable_bucketing=options["bucketing"],
                         gpu_memory_utilization=gpu_memory_utilization,
                         max_context_length=options["max_context_length"])
    click.echo(result.to_json() if as_json else result.summary())
    if check and (result.fits is False or result.host_fits is False):
        sys.exit(1)


@main.command()
@verbosity_options
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
@click.option("--revision", default="main", show_default=True, help="Branch to commit to (created from main if missing).")
@click.option("--commit-message", help="Default: 'Upload <name> (<format>, g4 <version>)'.")
@click.option("--dry-run", is_flag=True, help="List the files and print the model card; send nothing, need no token.")
@click.option("--allow-existing", is_flag=True,
              help="Replace the content of a repo that already holds other files (deleted in the same commit).")
@click.option("--base-model", help="Hub repo id of the source model, for the card's base_model (when g4 could not "
                                   "tell it from SRC).")
@click.option("--max-file-size", type=ByteSize(), metavar="SIZE",
              help="Per-file limit checked before upload, e.g. 50GB (GB = 10**9 bytes). Default: the Hub's, "
                   "200GB (HUB_MAX_FILE_BYTES).")
@exit_on_user_error
def push(out, repo_id, private, revision, commit_message, dry_run, allow_existing, base_model, max_file_size):
    """Publish the g4 result OUT to the Hugging Face Hub repo REPO_ID (namespace/name).

    \b
    One commit holds every file, so the repo never points at a missing shard; an
    interrupted upload resumes on rerun without sending finished files again; the remote
    files are then compared with OUT (names, sizes, hashes). The model card (README.md)
    is re-rendered first. Token: HF_TOKEN or `hf auth login`.
    """
    quiet_http_logs()
    report = push_result(out, repo_id, private=private, revision=revision, commit_message=commit_message,
                         dry_run=dry_run, allow_existing=allow_existing, base_model=base_model,
                         max_file_bytes=None if max_file_size is None else size_option("--max-file-size", max_file_size))
    echo_report(report, out)


def size_option(option: str, text: str) -> int:
    """``text`` as a byte size (:func:`g4.core.sizes.parse_size`), its error naming ``option``.

    Raises:
        OptionError: not a size.
    """
    try:
        return parse_size(text)
    except OptionError as e:
        raise OptionError(f"{option}: {e}") from e


if __name__ == "__main__":
    main()
