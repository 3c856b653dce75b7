"""Every numeric option of g4convert and g4serve is range-checked before any work: a click
usage error naming the option (exit status 2) and nothing written."""

import pytest
from click.testing import CliRunner

from g4.convert.cli import main as g4convert
from g4.serve.cli import main as g4serve

REPORT = b'{"passed": true}\n'


@pytest.fixture
def place(tmp_path):
    """tmp_path with an existing OUT holding a verification.json (for the commands that need
    an existing directory); returns (tmp_path, OUT, a new output path)."""
    out = tmp_path / "result"
    out.mkdir()
    (out / "verification.json").write_bytes(REPORT)
    return tmp_path, out, tmp_path / "new"


def _files(root):
    return sorted((p.relative_to(root), p.read_bytes() if p.is_file() else None) for p in root.rglob("*"))


G4CONVERT = [
    (["nvfp4", "embedded", "{new}", "--calib-samples", "0"], "--calib-samples"),
    (["nvfp4", "embedded", "{new}", "--calib-seq-len", "4"], "--calib-seq-len"),
    (["nvfp4", "embedded", "{new}", "--calib-batch-size", "0"], "--calib-batch-size"),
    (["nvfp4", "embedded", "{new}", "--weight-only", "--max-shard-size", "0.1KB"], "--max-shard-size"),
    (["nvfp4", "embedded", "{new}", "--weight-only", "--max-shard-size", "999999B"], "--max-shard-size"),
    (["nvfp4", "embedded", "{new}", "--weight-only", "--max-shard-size", "5000000"], "--max-shard-size"),
    (["nvfp4", "embedded", "{new}", "--weight-only", "--max-shard-size", "0"], "--max-shard-size"),
    (["nvfp4", "embedded", "{new}", "--weight-only", "--max-shard-size", "-1GB"], "--max-shard-size"),
    (["nvfp4", "embedded", "{new}", "--weight-only", "--max-shard-size", "nan"], "--max-shard-size"),
    (["int8-neuron", "embedded", "{new}", "--tp", "0"], "--tp"),
    (["int8-neuron", "embedded", "{new}", "--algorithm", "gptq", "--calib-samples", "0"], "--calib-samples"),
    (["int8-neuron", "embedded", "{new}", "--algorithm", "gptq", "--calib-seq-len", "4"], "--calib-seq-len"),
    (["verify", "{out}", "--min-agreement", "1.5"], "--min-agreement"),
    (["verify", "{out}", "--min-agreement", "nan"], "--min-agreement"),
    (["verify", "{out}", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["plan", "gemma-4-26B-A4B", "--format", "bf16", "--gpu-mem", "80"], "--gpu-mem"),
    (["plan", "gemma-4-26B-A4B", "--format", "bf16", "--gpu-mem", "0GB"], "--gpu-mem"),
    (["plan", "gemma-4-26B-A4B", "--format", "bf16", "--gpu-mem", "nan"], "--gpu-mem"),
    (["plan", "gemma-4-26B-A4B", "--tp", "0"], "--tp"),
    (["plan", "gemma-4-26B-A4B", "--seq-len", "0"], "--seq-len"),
    (["plan", "gemma-4-26B-A4B", "--batch", "-1"], "--batch"),
    (["plan", "gemma-4-26B-A4B", "--format", "nvfp4", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["synth", "{new}", "--layers", "0"], "--layers"),
    (["synth", "{new}", "--seed", str(2**64)], "--seed"),
    (["synth", "{new}", "--max-shard-size", "10KB"], "--max-shard-size"),
    (["push", "{out}", "me/model", "--dry-run", "--max-file-size", "100"], "--max-file-size"),
]

G4SERVE = [
    (["check", "{out}", "--against", "embedded", "--min-agreement", "5"], "--min-agreement"),
    (["check", "{out}", "--against", "embedded", "--min-agreement", "-0.1"], "--min-agreement"),
    (["check", "{out}", "--against", "embedded", "--min-agreement", "nan"], "--min-agreement"),
    (["check", "{out}", "--against", "embedded", "--max-tokens", "0"], "--max-tokens"),
    (["check", "{out}", "--against", "embedded", "--chat-max-tokens", "0"], "--chat-max-tokens"),
    (["{out}", "--port", "0"], "--port"),
    (["{out}", "--port", "65536"], "--port"),
    (["{out}", "--max-model-len", "0"], "--max-model-len"),
    (["{out}", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
]


@pytest.mark.parametrize("cli, args, option", [(g4convert, a, o) for a, o in G4CONVERT]
                         + [(g4serve, a, o) for a, o in G4SERVE],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_out_of_range_is_a_usage_error_before_any_work(place, cli, args, option):
    root, out, new = place
    before = _files(root)
    r = CliRunner().invoke(cli, [a.format(out=out, new=new) for a in args])
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.output  # one line, not click's usage block
    assert r.stderr.startswith(f"error: Invalid value for '{option}'"), r.output
    assert _files(root) == before  # nothing written; OUT/verification.json untouched
    assert (out / "verification.json").read_bytes() == REPORT


USAGE_ERRORS = [
    (g4convert, "g4convert", ["nvfp4", "--bogus"], "No such option '--bogus'", "g4convert nvfp4"),
    (g4convert, "g4convert", ["verify"], "Missing argument 'OUT'", "g4convert verify"),
    (g4convert, "g4convert", ["nvfp4", "--preset", "nope"],
     "Invalid value for '--preset': 'nope' is not one of 'default',", "g4convert nvfp4"),
    (g4convert, "g4convert", ["frob"], "No such command 'frob'", "g4convert"),
    (g4convert, "g4convert", ["--bogus", "nvfp4"], "No such option '--bogus'", "g4convert"),
    (g4serve, "g4serve", ["check"], "Missing argument 'OUT'", "g4serve check"),
    (g4serve, "g4serve", ["check", "{out}"], "Missing option '--against'", "g4serve check"),
    (g4serve, "g4serve", ["check", "{out}", "--against", "embedded", "--backend", "nope"],
     "Invalid value for '--backend': 'nope' is not one of 'auto', 'cpu', 'vllm', 'neuron'", "g4serve check"),
    (g4serve, "g4serve", ["{out}", "--bogus"], "No such option '--bogus'", "g4serve serve"),
]


@pytest.mark.parametrize("cli, prog, args, what, command", USAGE_ERRORS,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_usage_errors_are_one_error_line(place, cli, prog, args, what, command):
    """Unknown option or command, missing argument, bad choice: one ``error:`` line on stderr
    naming what is wrong and pointing at the command's --help, exit status 2."""
    root, out, new = place
    r = CliRunner().invoke(cli, [a.format(out=out, new=new) for a in args], prog_name=prog)
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"error: {what}"), r.stderr
    assert r.stderr.rstrip().endswith(f"(see '{command} --help')"), r.stderr


@pytest.mark.parametrize("cli, prog, args", [(g4convert, "g4convert", []), (g4convert, "g4convert", ["nvfp4"]),
                                             (g4serve, "g4serve", []), (g4serve, "g4serve", ["check"])])
def test_help_is_clicks_own(cli, prog, args):
    """--help (and a bare group) still print click's usage and options, not an error line."""
    r = CliRunner().invoke(cli, [*args, "--help"], prog_name=prog)
    assert r.exit_code == 0 and r.stderr == "" and r.stdout.startswith("Usage: ") and "Options:" in r.stdout
    if not args:
        bare = CliRunner().invoke(cli, [], prog_name=prog)
        assert bare.exit_code == 2 and bare.stderr == r.stdout  # click's help, on stderr (no_args_is_help)


def test_size_floor_and_units_are_explained(tmp_path):
    r = CliRunner().invoke(g4convert, ["nvfp4", "embedded", str(tmp_path / "o"), "--max-shard-size", "0.1KB"])
    assert "'0.1KB' is 100 bytes, less than the minimum of 1,000,000 bytes" in r.output
    r = CliRunner().invoke(g4convert, ["push", str(tmp_path), "me/model", "--dry-run", "--max-file-size", "80"])
    assert "size '80' has no unit: write e.g. 80GB (10**9 bytes), 80GiB (2**30 bytes) or 80B (bytes)" in r.output
    r = CliRunner().invoke(g4convert, ["plan", "gemma-4-26B-A4B", "--format", "bf16", "--gpu-mem", "80"])
    assert "size '80' has no unit: write e.g. 80GB (10**9 bytes), 80GiB (2**30 bytes) or 80B (bytes)" in r.output
    r = CliRunner().invoke(g4convert, ["plan", "gemma-4-26B-A4B", "--format", "bf16", "--gpu-mem", "80GB"])
    assert r.exit_code == 0 and "GPUs of 80.00 GB" in r.output


def test_tp_beyond_the_targets_cores_names_the_targets_that_have_them(tmp_path):
    """--force overrides the memory verdict only; the error says which --target has the cores."""
    r = CliRunner().invoke(g4convert, ["-q", "int8-neuron", "embedded", str(tmp_path / "o"), "--tp", "4", "--force"])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert ("--tp 4 needs 4 NeuronCores; inf2.xlarge has 2: use --target inf2.24xlarge or inf2.48xlarge or "
            "trn1.32xlarge (--force overrides only the memory verdict, never the core count)") in r.output
    assert not (tmp_path / "o").exists()
    r = CliRunner().invoke(g4convert, ["int8-neuron", "--help"])
    assert "more ranks than the target has NeuronCores is always refused" in " ".join(r.output.split())
