"""Planted-fault harness: does each conformance lane catch the faults it exists to catch?

``python -m tests.planted_faults`` (from the repository root, with the test environment's python)
copies the working tree into a scratch folder once per fault, applies one fault to the package
there (a source edit, listed in :data:`FAULTS`), runs the lanes that fault belongs to against that
copy, and prints one line per fault: caught (by how many tests of each lane, and which) or
SURVIVED. It exits 1 if any fault survives a lane it names, 2 if the unfaulted lanes do not pass
first (then no fault can be judged) or a lane cannot run here. Not part of the default test run
(``tests/test_planted_faults.py`` only checks that every edit still applies and that a scratch
copy imports as ``g4``); the closing note of a stop gives its table.

Lanes (each a pytest file run whole against the scratch copy):

- ``nxdi``: ``tests/lanes/test_nxdi_gemma4.py``, g4's NxDI class in NxD Inference 0.8's CPU engine
  against transformers' Gemma 4;
- ``nxd``: ``tests/lanes/test_nxd_cpu.py``, g4's int8 rank files against NxD's own quantizer and
  sharder;
- ``vllm``: ``tests/lanes/test_vllm_cpu.py``, g4's NVFP4 export through vLLM's loader and kernels.

The NxD/NxDI lanes need the NxD / NxDI sources (``G4_NXD_SRC`` / ``G4_NXDI_SRC``, default
``../shared/vendor/...`` beside the repository) and the NxDI lane's transformers 4.57 overlay
(``G4_NXDI_OVERLAY``, default ``.venv-nxdi/tf457``); the vLLM lane the vLLM environment
(``G4_VLLM_PYTHON``, default ``.venv-vllm/bin/python``). The harness resolves those defaults
against this repository and passes them to the copy, so nothing is rebuilt there.

How the copy is imported: a folder ``g4/`` of symlinks (``g4/core`` -> ``<copy>/core``, ...) first
on ``PYTHONPATH``. setuptools' editable finder is appended to ``sys.meta_path``, after the path
finder, so the copy wins over the editable install of this checkout; the harness checks it
(:func:`check_imports_from`) before it judges anything.

Time: one lane run per fault and lane plus one unfaulted run per lane; on 2 cores about 1.5 min
per NxDI run, 1 min per NxD run and 5-6 min per vLLM run (about 50 minutes for every fault).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the pyproject's package-dir mapping (g4.<name> -> <name>/)
PACKAGES = ("core", "convert", "quantizers", "exporters", "serve")
LANES = {
    "nxdi": "tests/lanes/test_nxdi_gemma4.py",
    "nxd": "tests/lanes/test_nxd_cpu.py",
    "vllm": "tests/lanes/test_vllm_cpu.py",
}
LANE_TIMEOUT_S = 3600
# never copied into the scratch tree (environments, build and work folders)
SKIP_DIRS = {".git", ".venv", ".venv-vllm", ".venv-nxdi", "__pycache__", ".pytest_cache", "_work", "build",
             "dist", "gemma4-tiny-nvfp4"}


@dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of ``old`` in ``path`` (relative to the repository) by ``new``."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Fault:
    """One planted fault: ``name``, what it does (``what``), its edits, and the lanes that must catch it."""

    name: str
    what: str
    edits: tuple[Edit, ...]
    lanes: tuple[str, ...]


def _f(name: str, what: str, lanes: str, *edits: tuple[str, str, str]) -> Fault:
    return Fault(name, what, tuple(Edit(*e) for e in edits), tuple(lanes.split(",")))


NXDI = "serve/nxdi_gemma4.py"
FAULTS: tuple[Fault, ...] = (
    # ---- g4's NxDI class (what g4serve --backend neuron runs on inf2)
    _f("embed-scale-missing", "the device embedding not multiplied by sqrt(hidden_size)", "nxdi",
       (NXDI, "        return out * torch.tensor(self.embed_scale, dtype=self.weight.dtype)",
        "        return out")),
    _f("embed-scale-fp32", "the embedding scaled by the fp32 sqrt(hidden_size), not rounded to bf16 "
       "(53.066 for 53.0 at H = 2816, case P12)", "nxdi",
       (NXDI, "embed_scale=embed_scale(config.hidden_size, dtype))", "embed_scale=config.hidden_size ** 0.5)"),
       (NXDI, "        return out * torch.tensor(self.embed_scale, dtype=self.weight.dtype)",
        "        return (out.float() * self.embed_scale).to(out.dtype)")),
    _f("experts-exact-gelu", "exact gelu in the experts (Gemma 4 uses the tanh approximation)", "nxdi",
       (NXDI, '    experts.mlp_op._activation_fn = partial(F.gelu, approximate="tanh")',
        "    experts.mlp_op._activation_fn = F.gelu")),
    _f("dense-exact-gelu", "exact gelu in the dense MLP", "nxdi",
       (NXDI, 'self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))',
        "self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))")),
    _f("dense-gate-up-swap", "the dense MLP's gelu on up_proj instead of gate_proj", "nxdi",
       (NXDI, 'self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))',
        'self.down_proj(F.gelu(self.up_proj(x), approximate="tanh") * self.gate_proj(x))')),
    _f("layer-scalar-dropped", "the residual stream not multiplied by layer_scalar", "nxdi",
       (NXDI, "        hidden_states = hidden_states * self.layer_scalar\n",
        "        hidden_states = hidden_states\n")),
    _f("per-expert-scale-dropped", "the router's top-k weights not multiplied by per_expert_scale", "nxdi",
       (NXDI, "        weights = weights * self.per_expert_scale[index]\n", "")),
    _f("rope-all-dims", "proportional RoPE on every dim of the full layers (partial_rotary_factor ignored)", "nxdi",
       (NXDI, '    angles = int(params.get("partial_rotary_factor", 1.0) * dim // 2)',
        "    angles = dim // 2")),
    # (the same numbers: the affinities are zero off the top-k; only the path taken tells. Leaving the
    # experts in training mode is no such fault: NxDI puts the whole model in eval mode before it runs)
    _f("all-experts-decode", "the experts built with top_k = num_experts: every token-generation step runs "
       "all experts (NxD's ExpertMLPsV2 selects by tokens x top_k / experts)", "nxdi",
       (NXDI, "top_k=config.top_k_experts,", "top_k=config.num_experts,")),
    _f("window-off-by-one", "sliding window q - k <= window instead of < window: the context-encoding mask, "
       "and a ring of window positions in token generation (window - 1 besides the new token)", "nxdi",
       (NXDI, "mask = mask & ((pos[:, None] - pos[None, :]) < self.sliding_window)",
        "mask = mask & ((pos[:, None] - pos[None, :]) <= self.sliding_window)"),
       ("core/gemma4.py", "out.append(min(sliding_window - 1, max_length))", "out.append(min(sliding_window, max_length))")),
    # ---- g4serve's neuron engine with several requests at once (NxDI continuous batching)
    _f("batch-encode-slot0", "every request's context encoding written into KV cache line 0 (seq_ids [0], "
       "not its own slot)", "nxdi",
       ("serve/neuron_backend.py", "seq_ids=torch.tensor([slot], dtype=torch.int32),",
        "seq_ids=torch.zeros(1, dtype=torch.int32),")),
    _f("batch-rows-reversed", "each request handed another row of the token-generation call's logits", "nxdi",
       ("serve/neuron_backend.py", "        return out.logits[:, -1].float()\n",
        "        return out.logits[:, -1].float().flip(0)\n")),
    # ---- long sequences: context encoding up to max_context_length, token generation to max_length
    _f("decode-full-first-bucket", "token generation's full layers attend only to the first 32 cached positions "
       "(one context-encoding bucket's worth of the KV cache)", "nxdi",
       ("serve/nxdi_gemma4.py",
        "                mask = attention_mask.to(torch.bool)  # [B, 1, 1, n_positions], True where cached\n",
        "                mask = attention_mask.to(torch.bool)  # [B, 1, 1, n_positions], True where cached\n"
        "                mask = mask & (torch.arange(mask.shape[-1]) < 32)\n")),
    _f("prompt-cap-max-length", "NxDI's CPU mode built with max_context_length = max_length (prompts padded to the "
       "KV cache length, not the longest prompt)", "nxdi",
       ("serve/neuron_backend.py", "settings.update(on_cpu=True, max_context_length=cte[-1])",
        "settings.update(on_cpu=True, max_context_length=length)")),
    _f("prompt-cap-unchecked", "the neuron engine takes prompts up to max_length, past its largest "
       "context-encoding bucket", "nxdi",
       ("serve/neuron_backend.py", "        if len(prompt_ids) > self.max_prompt:\n",
        "        if len(prompt_ids) > self.max_length:\n")),
    # ---- int8-neuron weights and their sharding
    _f("int8-absmax-128", "int8 per-channel scales absmax / 128 instead of NxD's absmax / 127", "nxd,nxdi",
       ("quantizers/int8.py", "INT8_QMAX = 127.0", "INT8_QMAX = 128.0")),
    _f("int8-scale-rows-rank0", "every TP rank given rank 0's scale rows of a column-parallel linear", "nxd,nxdi",
       ("exporters/neuron_int8.py",
        "        rows = slice(rank * per, (rank + 1) * per)\n        return w[rows], None if s is None else s[rows]\n",
        "        rows = slice(rank * per, (rank + 1) * per)\n        return w[rows], None if s is None else s[:per]\n")),
    _f("int8-expert-up-gate-order", "each rank's fused expert columns up first, then gate", "nxd,nxdi",
       ("exporters/neuron_int8.py", "        return x.view(n_exp, 2, tp, two_i // 2 // tp, x_dim).permute(2, 0, 4, 1, 3)",
        "        return x.view(n_exp, 2, tp, two_i // 2 // tp, x_dim).flip(1).permute(2, 0, 4, 1, 3)")),
    # ---- NVFP4 (what vLLM loads)
    _f("e2m1-nibble-swap", "the odd element of each pair in the low nibble (modelopt: the even one)", "vllm",
       ("quantizers/nvfp4.py", "    return ((pairs & 0xF) | ((pairs >> 4) & 0xF0)).to(torch.uint8)",
        "    return (((pairs >> 8) & 0xF) | ((pairs << 4) & 0xF0)).to(torch.uint8)")),
    _f("scale-key-renamed", "the global scale written as weight_scale2 (modelopt: weight_scale_2)", "vllm",
       ("exporters/nvfp4_names.py", '    WEIGHT_SCALE_2 = "weight_scale_2"', '    WEIGHT_SCALE_2 = "weight_scale2"')),
    _f("expert-gate-up-unshared", "each expert's gate and up quantized with their own global scale "
       "(vLLM keeps one for the fused w13)", "vllm",
       ("convert/nvfp4.py", "        qgu = q.quantize_experts(w[gate.source], method=algorithm, amax=known.get(gate.source))\n",
        "        qgu = q.quantize_experts(w[gate.source], method=algorithm, amax=known.get(gate.source))\n"
        "        qg, qu = (q.quantize_experts(h.contiguous(), method=algorithm) for h in split_gate_up(w[gate.source]))\n"),
       ("convert/nvfp4.py",
        "        yield from _named(gate, (gate_w, gate_s, qgu.weight_scale_2[e].clone(), in_gu))\n"
        "        yield from _named(up, (up_w, up_s, qgu.weight_scale_2[e].clone(), in_gu))\n",
        "        yield from _named(gate, (qg.weight[e], qg.weight_scale[e], qg.weight_scale_2[e].clone(), in_gu))\n"
        "        yield from _named(up, (qu.weight[e], qu.weight_scale[e], qu.weight_scale_2[e].clone(), in_gu))\n")),
    _f("input-scale-x2", "every calibrated input_scale doubled", "vllm",
       ("convert/nvfp4.py", "        a = fallback\n    return q.global_scale_from_amax(a)",
        "        a = fallback\n    return q.global_scale_from_amax(2 * a)")),
)


# ------------------------------------------------------------------------------ the scratch copy

def apply(fault: Fault, root: Path) -> None:
    """Apply ``fault``'s edits to the tree at ``root``.

    Raises:
        ValueError: an edit's ``old`` text does not occur exactly once in its file (the code moved:
            the fault list must follow it).
    """
    for e in fault.edits:
        path = root / e.path
        text = path.read_text()
        n = text.count(e.old)
        if n != 1:
            raise ValueError(f"fault {fault.name}: {e.path} holds the text to replace {n} times, not once: {e.old!r}")
        path.write_text(text.replace(e.old, e.new))


def tree_files(repo: Path = REPO) -> list[str]:
    """The working tree's files as git sees them (tracked and untracked-but-not-ignored), relative
    paths; the folders in :data:`SKIP_DIRS` left out."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout.decode()
    return [p for p in out.split("\0") if p and not SKIP_DIRS.intersection(Path(p).parts)
            and (repo / p).is_file()]


def make_copy(dest: Path, repo: Path = REPO, files: list[str] | None = None) -> Path:
    """Copy the working tree at ``repo`` (``files``, relative paths; default :func:`tree_files`) into
    ``dest`` (created) and add the ``g4`` shim there; return the shim folder, the one to put first on
    ``PYTHONPATH``."""
    for rel in tree_files(repo) if files is None else files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)
    shim = dest / ".g4-shim"
    (shim / "g4").mkdir(parents=True)
    for pkg in PACKAGES:
        (shim / "g4" / pkg).symlink_to(dest / pkg, target_is_directory=True)
    return shim


def lane_env(shim: Path, repo: Path = REPO) -> dict[str, str]:
    """The environment a lane runs under in the copy: the shim first on ``PYTHONPATH``, and the
    lanes' outside inputs resolved against this repository (set explicitly where unset)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    vendor = repo.parent / "shared" / "vendor"
    defaults = {"G4_NXD_SRC": vendor / "neuronx-distributed-v2.28.0" / "src",
                "G4_NXDI_SRC": vendor / "neuronx-distributed-inference-v0.8.0" / "src",
                "G4_NXDI_OVERLAY": repo / ".venv-nxdi" / "tf457"}
    vllm = repo / ".venv-vllm" / "bin" / "python"
    if vllm.is_file():
        defaults["G4_VLLM_PYTHON"] = vllm
    for k, v in defaults.items():
        env.setdefault(k, str(v))
    return env


def check_imports_from(root: Path, env: dict[str, str]) -> None:
    """Raise RuntimeError unless ``g4``'s packages import from ``root`` under ``env``."""
    code = "import sys, " + ", ".join(f"g4.{p}" for p in PACKAGES) + "\n" + \
           "print('\\n'.join(sys.modules[f'g4.{p}'].__file__ for p in %r))" % (PACKAGES,)
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    files = res.stdout.split()
    if res.returncode or len(files) != len(PACKAGES) or not all(
            Path(f).resolve().is_relative_to(root.resolve()) for f in files):
        raise RuntimeError(f"the copy at {root} is not what `import g4` finds: {res.stdout}{res.stderr}")


# ------------------------------------------------------------------------------ running a lane

@dataclass
class LaneRun:
    """One pytest run of a lane: counts, the failed (or errored) test ids, the reason for skips."""

    lane: str
    rc: int
    seconds: float
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    tail: str = ""

    @property
    def ran(self) -> bool:
        """At least one test of the lane ran (not all skipped, collection did not fail)."""
        return self.passed + len(self.failed) > 0


def run_lane(lane: str, root: Path, env: dict[str, str], timeout: float = LANE_TIMEOUT_S) -> LaneRun:
    """Run lane ``lane`` (a key of :data:`LANES`) in the tree at ``root``; parse pytest's JUnit XML."""
    xml = root / f".lane-{lane}.xml"
    t0 = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                              f"--junitxml={xml}", LANES[lane]], cwd=root, env=env, capture_output=True,
                             text=True, timeout=timeout)
        rc, out = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    run = LaneRun(lane, rc, time.monotonic() - t0, tail="\n".join(str(out).splitlines()[-15:]))
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name", "?")
            kinds = {child.tag for child in case}
            if kinds & {"failure", "error"}:
                run.failed.append(name)
            elif "skipped" in kinds:
                run.skipped.append(name + ": " + (case.find("skipped").get("message") or ""))
            else:
                run.passed += 1
    return run


def failed_tests(names: list[str]) -> str:
    """Test ids grouped by test function, parameters joined, ``test_`` dropped:
    ``["test_a[x]", "test_a[y]", "test_b"]`` -> ``"a[x,y], b"``."""
    groups: dict[str, list[str]] = {}
    for name in names:
        base, _, param = name.partition("[")
        groups.setdefault(base.removeprefix("test_"), []).append(param.removesuffix("]"))
    return ", ".join(base + (f"[{','.join(p for p in params if p)}]" if any(params) else "")
                     for base, params in groups.items())


def summary(run: LaneRun) -> str:
    """``lane: caught by N of M (the failed tests, grouped)`` or ``lane: SURVIVED (M passed)``."""
    total = run.passed + len(run.failed)
    if not run.ran:
        return f"{run.lane}: DID NOT RUN (rc {run.rc}; {run.skipped[0] if run.skipped else run.tail[-300:]})"
    if not run.failed:
        return f"{run.lane}: SURVIVED ({run.passed} passed)"
    return f"{run.lane}: caught by {len(run.failed)} of {total} ({failed_tests(run.failed)})"


# ------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    """Run the harness; see the module docstring. Returns the exit status (0 all caught, 1 a fault
    survived, 2 the unfaulted lanes failed or could not run)."""
    p = argparse.ArgumentParser(prog="python -m tests.planted_faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the faults and their lanes, run nothing")
    p.add_argument("--only", nargs="+", metavar="FAULT", help="these faults only")
    p.add_argument("--lanes", help="comma-separated lanes to run (default: every lane a chosen fault names)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unfaulted runs (trust that the lanes pass)")
    p.add_argument("--keep", action="store_true", help="keep the scratch copies (their path is printed)")
    args = p.parse_args(argv)

    faults = [f for f in FAULTS if not args.only or f.name in args.only]
    unknown = set(args.only or ()) - {f.name for f in FAULTS}
    if unknown:
        print(f"error: no such fault: {', '.join(sorted(unknown))} (--list names them)", file=sys.stderr)
        return 2
    if args.list:
        for f in faults:
            print(f"{f.name:28s} {','.join(f.lanes):9s} {f.what}")
        return 0
    lanes = [x for x in LANES if any(x in f.lanes for f in faults)]
    if args.lanes:
        lanes = [x for x in args.lanes.split(",") if x in LANES]
        faults = [f for f in faults if set(f.lanes) & set(lanes)]

    scratch = Path(tempfile.mkdtemp(prefix="g4-planted-"))
    t_all = time.monotonic()
    status = 0
    try:
        # the tree as it is now, once: edits made here while the harness runs do not reach later faults
        files, base = tree_files(), scratch / "tree"
        make_copy(base, files=files)

        def copy(root: Path) -> dict[str, str]:
            return lane_env(make_copy(root, base, files))

        if not args.no_baseline:
            for lane in lanes:
                root = scratch / f"baseline-{lane}"
                env = copy(root)
                check_imports_from(root, env)
                run = run_lane(lane, root, env)
                print(f"{'(no fault)':28s} {lane}: {run.passed} passed, {len(run.failed)} failed  "
                      f"[{run.seconds:.0f} s]", flush=True)
                if run.failed or not run.ran:
                    print(f"error: lane {lane} does not pass unfaulted, so no fault can be judged on it:\n{run.tail}",
                          file=sys.stderr)
                    return 2
        for f in faults:
            root = scratch / f.name
            env = copy(root)
            apply(f, root)
            check_imports_from(root, env)
            parts = []
            for lane in [x for x in f.lanes if x in lanes]:
                run = run_lane(lane, root, env)
                parts.append(f"{summary(run)} [{run.seconds:.0f} s]")
                if not run.ran:
                    status = max(status, 2)
                elif not run.failed:
                    status = max(status, 1)
            print(f"{f.name:28s} " + "; ".join(parts), flush=True)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        print(f"{len(faults)} faults, {time.monotonic() - t_all:.0f} s in all; "
              + ("every fault caught by every lane it names" if status == 0 else
                 "a fault SURVIVED a lane it names" if status == 1 else "a lane did not run"), flush=True)
        return status
    finally:
        if args.keep:
            print(f"scratch copies kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
