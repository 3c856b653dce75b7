"""Ranges of the numeric command-line options of ``g4convert`` and ``g4serve``, one
definition per kind of value, and the click pieces both console scripts share.

Every command declares its numeric options with these types, so a value out of range is a
click usage error (exit status 2, the option named) before any file is read or written;
:class:`OneLineUsageGroup` prints every usage error as one ``error:`` line.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from g4.core.errors import OptionError
from g4.core.sizes import parse_size

#: How many of something (samples, sequences, decoder layers, tokens to generate): at least 1.
COUNT = click.IntRange(min=1)

@contextmanager
def _usage_error_in_one_line():
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:  # a bare command prints its help, as click does
        raise
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "the command"
        click.echo(f"error: {' '.join(e.format_message().split())} (see '{where} --help')", err=True)
        raise click.exceptions.Exit(e.exit_code) from None


class OneLineUsageGroup(click.Group):
    """The group of both console scripts: a click usage error (an unknown option or command, a
    missing argument, a value out of range or not among the choices), in the group or in any of
    its commands, prints one line on stderr, ``error: <click's message> (see 'CMD --help')``,
    and exits with click's status 2, instead of click's usage block. ``--help`` and the help a
    bare group prints are click's own."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _usage_error_in_one_line():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with _usage_error_in_one_line():  # the subcommand's arguments are parsed here
            return super().invoke(ctx)


#: A TCP port to listen on or connect to.
PORT = click.IntRange(1, 65535)

#: What ``torch.Generator.manual_seed`` takes: from -2**63 to 2**64 - 1.
SEED = click.IntRange(-(2**63), 2**64 - 1)

#: Whole seconds, at most a day (``g4serve --shutdown-timeout``).
SECONDS = click.IntRange(0, 86400)


class _Fraction(click.FloatRange):
    """A float in [0, 1]; nan is refused (it compares false with both ends of the range)."""

    name = "fraction"

    def __init__(self) -> None:
        super().__init__(0.0, 1.0)

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if math.isnan(rv):
            self.fail(f"{value!r} is not a number in the range {self._describe_range()}.", param, ctx)
        return rv


#: A share such as a token agreement: a number from 0 to 1.
FRACTION = _Fraction()


class ByteSize(click.ParamType):
    """A byte size with its unit (``80GB`` = 80 * 10**9 bytes, ``128GiB`` = 128 * 2**30),
    at least ``minimum`` bytes. The value passed on is the text as given (checked), for
    :func:`g4.core.sizes.parse_size`.

    A number without a unit is refused: ``--gpu-mem 80`` would otherwise be 80 bytes.
    """

    name = "size"

    def __init__(self, minimum: int = 1, why: str = "") -> None:
        self.minimum = minimum
        self.why = why

    def convert(self, value, param, ctx):

        try:
            n = parse_size(value)
        except OptionError as e:
            self.fail(str(e), param, ctx)
        if n < self.minimum:
            self.fail(f"{value!r} is {n:,} bytes, less than the minimum of {self.minimum:,} bytes"
                      + (f" ({self.why})" if self.why else ""), param, ctx)
        return value.strip() if isinstance(value, str) else value


#: ``--max-shard-size``: below 1 MB a checkpoint becomes thousands of files holding little
#: but headers (transformers' ``save_pretrained`` and modelopt's export accept any size).
MIN_SHARD_BYTES = 10**6
SHARD_SIZE = ByteSize(MIN_SHARD_BYTES, "smaller shards only multiply files")

min_agreement_option = click.option(
    "--min-agreement", type=FRACTION, default=0.9, show_default=True,
    help="Fail (exit 1) below this greedy token agreement, a fraction from 0 to 1.")

#: ``g4serve``, ``g4serve check`` and ``g4convert verify``: one default, so that verify and check
#: compute the same arithmetic unless told otherwise.
act_quant_option = click.option(
    "--act-quant/--no-act-quant", default=None,
    help="CPU, NVFP4: emulate W4A4 activation quantization with the input_scales "
         "(default: on exactly when OUT is W4A4, as vLLM computes it on Blackwell).")


#: Suffixes of the text files the commands read (--calib-data, eval --text, check --prompts).
TEXT_SUFFIXES = (".txt", ".jsonl")


def text_file_suffix(path: str | Path, option: str, txt: str, jsonl: str) -> str:
    """``".txt"`` or ``".jsonl"``: how ``path``, given to ``option``, is read. Any other
    suffix (``.csv``, ``.json``, none) is refused rather than silently read as plain text.

    Args:
        txt, jsonl: what each kind holds, for the message (e.g. ``"documents separated by
            blank lines"``, ``"'text' or 'messages' per line"``).

    Raises:
        OptionError: ``<path>: <option> takes .txt (...) or .jsonl (...), not .csv``.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        got = suffix or "a file without a suffix"
        raise OptionError(f"{path}: {option} takes .txt ({txt}) or .jsonl ({jsonl}), not {got}")
    return suffix


# --------------------------------------------------------------------------- -q / -v

_QUIET, _VERBOSE, _DEFAULT_LEVEL = "g4.quiet", "g4.verbose", "g4.default_log_level"


def _meta() -> dict:
    ctx = click.get_current_context(silent=True)
    return ctx.meta if ctx is not None else {}


def is_quiet() -> bool:
    """Whether ``-q`` was given, before or after the subcommand (False outside a command)."""
    return bool(_meta().get(_QUIET))


def is_verbose() -> bool:
    """Whether ``-v`` was given, before or after the subcommand (False outside a command)."""
    return bool(_meta().get(_VERBOSE))


def configure_output(default_level: int | None = None) -> None:
    """Apply ``-q`` / ``-v`` to logging and to the libraries' own output: the root logger at
    DEBUG with ``-v``, WARNING with ``-q``, else ``default_level`` (what the group chose; kept
    from an earlier call when None); with ``-q`` transformers logs errors only and
    huggingface_hub draws no progress bar (the environment variables they read when imported,
    and their switches when they already are)."""
    meta = _meta()
    if default_level is not None:
        meta[_DEFAULT_LEVEL] = default_level
    if meta.get(_QUIET):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
    level = (logging.DEBUG if meta.get(_VERBOSE) else logging.WARNING if meta.get(_QUIET)
             else meta.get(_DEFAULT_LEVEL, logging.INFO))
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    logging.getLogger().setLevel(level)


def _set_flag(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta[_QUIET if param.name == "quiet" else _VERBOSE] = True
        if _DEFAULT_LEVEL in ctx.meta:  # the group has set up output: apply the flag given after the subcommand
            configure_output()
    return value


def verbosity_options(fn):
    """``-q/--quiet`` and ``-v/--verbose``, one definition for both console scripts: put on the
    group and on each of its commands, so that either works before or after the subcommand
    name (``g4convert -q nvfp4`` and ``g4convert nvfp4 -q``). The values are read with
    :func:`is_quiet` / :func:`is_verbose` (they are not passed to the command function)."""
    fn = click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=_set_flag,
                      help="Log every step (DEBUG).")(fn)
    return click.option("-q", "--quiet", is_flag=True, expose_value=False, callback=_set_flag,
                        help="Only warnings and errors; no progress bar.")(fn)
