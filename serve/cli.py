"""``g4serve``: serve a g4 result behind an OpenAI-compatible API, or check it end to end.

``g4serve OUT ...`` is short for ``g4serve serve OUT ...``: a first argument that is not a
subcommand is taken as OUT.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path

import click

from g4.convert.options import (
    COUNT,
    PORT,
    SECONDS,
    OneLineUsageGroup,
    act_quant_option,
    configure_output,
    is_quiet,
    is_verbose,
    min_agreement_option,
    verbosity_options,
)
from g4.convert.resolve import resolve_source
from g4.core.checkpoint import SRC_FORMS
from g4.core.errors import G4Error, exit_on_user_error
from g4.exporters.formats import INT8_NEURON, check_result
from g4.exporters.vllm_command import kv_cache_warning
from g4.serve.backends import choose_backend
from g4.serve.check import check_prompts_file, run_check
from g4.serve.engine import load_cpu_engine
from g4.serve.neuron_backend import compile_neuron, load_neuron_engine
from g4.serve.server import create_app, run_server
from g4.serve.vllm_backend import VllmServer

USAGE = ("g4serve OUT [--backend auto|cpu|vllm|neuron] [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]\n"
         "            [--shutdown-timeout 30]\n"
         "       g4serve check OUT --against SRC [--prompts FILE] [--min-agreement 0.9] [--url URL] "
         "[--max-tokens N]\n"
         "       g4serve compile OUT [--compiled-dir DIR]")


class _OutFirstGroup(OneLineUsageGroup):
    """A group whose first positional may be OUT: anything that is not a subcommand (or the
    group's own --help/--version) is routed to ``serve``."""

    def parse_args(self, ctx, args):
        i = 0  # the group's own flags (-q, -v) may come first: g4serve -q OUT, g4serve -q check OUT
        while i < len(args) and args[i] in ("-q", "--quiet", "-v", "--verbose"):
            i += 1
        if i < len(args) and args[i] not in self.commands and args[i] not in ("-h", "--help", "--version"):
            args = [*args[:i], "serve", *args[i:]]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx, formatter):
        formatter.write(f"Usage: {USAGE}\n")


def _terminate(signum, frame):
    raise KeyboardInterrupt


@click.group(cls=_OutFirstGroup, context_settings={"help_option_names": ["-h", "--help"]}, no_args_is_help=True)
@click.version_option(package_name="g4", prog_name="g4serve")
@verbosity_options
def main() -> None:
    """Serve a converted Gemma 4 result (NVFP4, int8-neuron, or a bf16 checkpoint) behind an
    OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics),
    or check it end to end.

    \b
    Backends: vllm (NVFP4 with vLLM and a CUDA GPU), neuron (int8-neuron on NeuronCores),
    cpu (reference: NVFP4 dequantized into transformers' Gemma 4, int8-neuron through the
    tensor-parallel emulator). --backend auto picks one from OUT's files and this machine
    and says why.

    \b
    Examples:
      g4convert nvfp4                                    # -> ./gemma4-tiny-nvfp4
      g4serve gemma4-tiny-nvfp4                          # http://127.0.0.1:8000/v1
      g4serve check gemma4-tiny-nvfp4 --against embedded # writes gemma4-tiny-nvfp4/verification.json
    """
    # the start-up guard (g4.serve.entry) is done: Ctrl-C is a KeyboardInterrupt again, SIGTERM the default
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    configure_output(logging.WARNING)  # -q / -v given after the subcommand apply when it parses them


def _setup_logging() -> None:
    """Serving output: transformers' and huggingface_hub's own lines and bars off (g4serve prints
    its own; model loading has g4's bar unless -q), then -q / -v as given."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:  # already imported (SRC downloaded): the variable came too late
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    configure_output()


_out_arg = click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
_backend_opt = click.option("--backend", type=click.Choice(["auto", "cpu", "vllm", "neuron"]), default="auto",
                            show_default=True, help="Where to run OUT; auto picks from its format and this machine.")
_dtype_opt = click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
                          show_default=True, help="CPU backend compute dtype of the transformers model.")


@main.command()
@_out_arg
@_backend_opt
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback by default).")
@click.option("--port", type=PORT, default=8000, show_default=True)
@click.option("--served-model-name", help="Model id clients send (default: OUT's directory name).")
@act_quant_option
@_dtype_opt
@click.option("--max-model-len", type=COUNT, help="vllm backend: --max-model-len (tokens).")
@click.option("--kv-cache-dtype", help="vllm backend: --kv-cache-dtype (auto, fp8, ...).")
@click.option("--compiled-dir", type=click.Path(file_okay=False, path_type=Path),
              help="neuron backend: where the compiled model is kept (default: OUT/neuron_compiled); compiled on "
                   "the first start, reused while it matches OUT, recompiled when it does not.")
@click.option("--max-batch-size", type=COUNT, default=1, show_default=True,
              help="neuron backend: requests generated at once (NxDI continuous batching, B KV cache lines; "
                   "compiled for it). Plan the memory with g4convert plan --batch B.")
@click.option("--shutdown-timeout", type=SECONDS, default=30, show_default=True,
              metavar="SECONDS", help="On SIGTERM or Ctrl-C, requests in flight get this long to finish; then "
              "they are answered 503 (a second Ctrl-C: at once). CPU and neuron backends.")
@verbosity_options
@exit_on_user_error
def serve(out, backend, host, port, served_model_name, act_quant, dtype, max_model_len, kv_cache_dtype,
          compiled_dir, max_batch_size, shutdown_timeout):
    """Serve OUT at http://HOST:PORT/v1 until SIGTERM or Ctrl-C."""
    _setup_logging()
    fmt = check_result(out)  # before anything loads or listens
    chosen, why = choose_backend(fmt, backend)
    click.echo(f"backend {chosen}: {why}")
    name = served_model_name or out.resolve().name
    if chosen == "vllm":
        # absolute: vLLM reports it as /v1/models root, which check --url compares with OUT
        _serve_vllm(out.resolve(), host, port, name, max_model_len, kv_cache_dtype)
        return
    if max_model_len or kv_cache_dtype:
        raise G4Error("--max-model-len and --kv-cache-dtype are vllm backend options")
    if compiled_dir and chosen != "neuron":
        raise G4Error("--compiled-dir is a neuron backend option")
    if max_batch_size > 1 and chosen != "neuron":
        raise G4Error(f"--max-batch-size is a neuron backend option (the {chosen} backend runs one request at a time)")
    sock = _bind(host, port)
    if chosen == "neuron":
        engine = load_neuron_engine(out, compiled_dir=compiled_dir, max_batch_size=max_batch_size, log=click.echo)
    else:
        engine = load_cpu_engine(out, act_quant=act_quant, dtype=dtype, fmt=fmt, progress=not is_quiet())

    app = create_app(engine, served_model_name=name)
    click.echo(f"engine: {engine.description}")
    at_once = "one request at a time" if engine.max_batch_size == 1 else f"up to {engine.max_batch_size} requests at once"
    click.echo(f"serving {name!r} on http://{host}:{sock.getsockname()[1]}/v1 ({at_once}; Ctrl-C stops)")
    # uvicorn re-raises SIGINT/SIGTERM after its shutdown (restoring the handlers it found): with
    # this handler both end in the except below, with "stopped" and exit code 0.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        run_server(app, sock, drain_s=shutdown_timeout, log_level="info" if is_verbose() else "warning")
    except KeyboardInterrupt:
        pass
    click.echo("stopped")


@main.command("compile")
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--compiled-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the compiled model (default: OUT/neuron_compiled).")
@click.option("--max-batch-size", type=COUNT, default=1, show_default=True,
              help="Compile for this many requests at once; serve with the same --max-batch-size.")
@verbosity_options
@exit_on_user_error
def compile_(out, compiled_dir, max_batch_size):
    """Compile the int8-neuron result OUT for NeuronCores (NxDI 0.8), without serving it.

    Runs on any x86 machine with the Neuron SDK 2.28 packages (neuronx-distributed,
    neuronx-distributed-inference, torch-neuronx); NeuronCores are not needed. The compile takes
    far more host RAM than serving: do it on a large box, then copy the folder to the serving
    box as OUT/neuron_compiled (or pass it there with --compiled-dir); g4serve --backend neuron
    loads it without compiling while its g4_compiled.json matches OUT.
    """

    _setup_logging()
    fmt = check_result(out)
    if fmt.format != INT8_NEURON:
        raise G4Error(f"{out}: {fmt.detail}; g4serve compile takes an int8-neuron result (g4convert int8-neuron)")
    compile_neuron(out, compiled_dir=compiled_dir, max_batch_size=max_batch_size, log=click.echo)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise G4Error(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def _serve_vllm(out: Path, host: str, port: int, name: str, max_model_len, kv_cache_dtype) -> None:
    warning = kv_cache_warning(out, kv_cache_dtype)
    if warning:
        click.echo(warning, err=True)
    signal.signal(signal.SIGTERM, _terminate)
    server = VllmServer(out, host=host, port=port, served_model_name=name, max_model_len=max_model_len,
                        kv_cache_dtype=kv_cache_dtype)
    click.echo(f"starting: {server.command.shell()}  (log {server.log_path})")
    with server:
        server.wait_ready()
        click.echo(f"serving {name!r} on {server.url} (Ctrl-C stops)")
        try:
            code = server.proc.wait()
        except KeyboardInterrupt:
            click.echo("stopping vLLM", err=True)
            return
    raise G4Error(f"vLLM exited with code {code} (log {server.log_path})")


@main.command()
@_out_arg
@click.option("--against", "src", required=True, help=f"The source checkpoint OUT was converted from: {SRC_FORMS}.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Prompt set: .txt (one per line) or .jsonl ({\"prompt\": ...}); default: SRC's facts.json "
                   "held-out prompts or built-in ones.")
@min_agreement_option
@click.option("--url", help="Check a server already running there (e.g. http://127.0.0.1:8000) instead of "
                            "starting one.")
@click.option("--max-tokens", type=COUNT, default=16, show_default=True,
              help="Tokens generated per prompt and fact.")
@click.option("--chat-max-tokens", type=COUNT, default=256, show_default=True,
              help="Tokens per P13 chat request (thinking on needs room) and per tool question.")
@_backend_opt
@click.option("--served-model-name", help="Model id to request (default: the server's first model).")
@act_quant_option
@_dtype_opt
@verbosity_options
@exit_on_user_error
def check(out, src, prompts_file, min_agreement, url, max_tokens, chat_max_tokens, backend, served_model_name,
          act_quant, dtype):
    """Serve OUT (or use --url), send the prompt set through /v1/chat/completions with the
    openai client, compare with SRC in transformers (greedy token agreement, first divergence,
    facts, tool calls, P13 chat checks), write OUT/verification.json and re-render OUT's model
    card. Exits 1 on FAIL."""
    if prompts_file is not None:
        check_prompts_file(prompts_file)  # before SRC is fetched or a server started
    src_dir = resolve_source(src)  # a repo id not in the HF cache downloads here, with its progress bar
    if not src_dir.is_dir():
        raise G4Error(f"--against {src}: not a directory ({SRC_FORMS})")
    _setup_logging()
    report = run_check(out, src_dir, source_label=src, prompts_file=prompts_file,
                       min_agreement=min_agreement, url=url, max_tokens=max_tokens, chat_max_tokens=chat_max_tokens,
                       backend=backend, act_quant=act_quant, dtype=dtype, served_model_name=served_model_name,
                       echo=click.echo, progress=not is_quiet())
    if report["passed"]:
        click.echo("PASS")
    else:
        click.echo(f"FAIL: {'; '.join(report['failures'])}")
        sys.exit(1)


if __name__ == "__main__":
    main()
