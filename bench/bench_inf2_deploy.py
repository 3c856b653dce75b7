"""The host side of the gemma-4-26B-A4B deploy on an inf2.xlarge (16 GiB host RAM), measured at the
real size on this CPU: does handing the TP-2 int8-neuron weights to the Neuron runtime fit the host?

    python bench/bench_inf2_deploy.py [--work bench/_work/inf2-deploy] [--limit-gib 14 4]

1. ``build``: a TP-2 ``g4convert int8-neuron`` result of gemma-4-26B-A4B at its real shapes (all
   30 layers, 128 experts, 262144-row vocabulary: 2 rank files of 13.98 GB, the 1.48 GB host
   embedding table, ``manifest.json``, ``config.json``), written straight from g4's layout table
   (:func:`g4.exporters.neuron_int8.expected_rank_specs`, the table the runtime checks the files
   against) with random int8 codes, fp32 scales and bf16 norms, so the 51.6 GB source is not
   needed. Kept in ``--work`` between runs (a stamp over the layout), about 29.5 GB of disk.
2. ``measure``, once per ``--limit-gib``: the rank files evicted from the page cache
   (``posix_fadvise(POSIX_FADV_DONTNEED)``: a cold deploy reads them from disk), then a child
   process inside a memory cgroup of that many GiB (cgroup v1 ``memory.limit_in_bytes`` or v2
   ``memory.max``, swap off in it) runs the path ``g4serve --backend neuron`` takes to hand the
   weights to NxD after ``load`` (``g4.serve.neuron_backend``): ``build_nxdi_model`` with the
   settings it compiles with (``nxdi_settings(on_cpu=False)``, bf16, the manifest's buckets),
   then the class's own ``load_weights``: :meth:`g4_rank_weights` builds the traced module on the
   meta device, reads both rank files (headers checked against the layout table, tensors
   memory-mapped by safetensors) and casts them with NxD's ``ModelBuilder.cast_weights``; then
   ``traced_model.nxd_model.initialize(weights, start_rank)``, which on Neuron is NxD's
   ``NxDModel.initialize`` (aws-neuron/neuronx-distributed ``src/neuronx_distributed/trace/spmd.py``:
   ``torch.ops.neuron._parallel_load(checkpoint)``, a host-to-device copy). Here it is a stand-in
   that reads every byte of every tensor once through a 64 MiB staging buffer, as a DMA
   from host memory reads it, and keeps nothing.

Prints per limit: OOM or not, the child's peak resident set split anonymous / file-backed (sampled
every 20 ms from ``/proc/PID/status``; ``VmHWM``), the cgroup's peak charge (anonymous memory plus
the page cache it holds), the bytes the stand-in read and the wall time. File-backed pages of
memory-mapped rank files are page cache the kernel drops under the limit; anonymous memory is
what cannot be dropped.

The limit: 16 GiB (inf2.xlarge, aws-neuron/aws-neuron-sdk ``general/arch/neuron-hardware/inf2-arch``)
minus 2 GiB for the OS, the Neuron runtime's host-side state and g4serve's HTTP server and
tokenizer: an allowance, not a measurement on inf2 (nothing here runs there); both figures are
g4.convert.plan's (``NEURON_TARGETS``, ``HOST_RESERVE_BYTES``). A second, tight limit shows how far below it the load still completes.

Needs NxD 2.28 and NxDI 0.8 source (``../shared/vendor`` beside the checkout, or ``G4_NXD_SRC`` /
``G4_NXDI_SRC``) and the transformers-4.57 overlay the NxDI lane builds (``.venv-nxdi/tf457``,
made by ``pytest tests/lanes/test_nxdi_gemma4.py``); the Neuron-only imports are the lane's stubs
(``tests/lanes/nxd_cpu/stubs.py``). Needs a writable memory cgroup (root).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENDOR = REPO.parent / "shared" / "vendor"
NXD_SRC = Path(os.environ.get("G4_NXD_SRC", VENDOR / "neuronx-distributed-v2.28.0" / "src"))
NXDI_SRC = Path(os.environ.get("G4_NXDI_SRC", VENDOR / "neuronx-distributed-inference-v0.8.0" / "src"))
OVERLAY = Path(os.environ.get("G4_NXDI_OVERLAY", REPO / ".venv-nxdi" / "tf457"))
TP = 2
TARGET = "inf2.xlarge"  # its host RAM and the OS/runtime/server allowance: g4.convert.plan's
STAGING_BYTES = 64 * 2**20
GiB = 2**30


# ------------------------------------------------------------------------------------------ build

def build(work: Path) -> Path:
    """The real-size TP-2 result in ``work/result`` (reused when its stamp matches). Returns its path."""
    import torch

    from g4.convert.synth import GEMMA4_26B_A4B
    from g4.exporters.neuron_int8 import (
        EMBED_FILE,
        EMBED_TENSOR,
        KEPT_DTYPE,
        WEIGHTS_DIR,
        Manifest,
        expected_rank_specs,
        geometry,
        rank_file,
        serving_max_length,
    )
    from g4.exporters.output_dir import atomic_output_dir
    from g4.exporters.safetensors_writer import ShardedSafetensorsWriter, TensorSpec

    config = GEMMA4_26B_A4B
    specs = expected_rank_specs(config, TP, quantize_attention=False)
    g = geometry(config, TP)
    vocab, hidden = config["text_config"]["vocab_size"], config["text_config"]["hidden_size"]
    stamp = hashlib.sha256(json.dumps([config, [(s.name, str(s.dtype), s.shape) for s in specs]],
                                      default=str).encode()).hexdigest()
    out = work / "result"
    if (out / "bench-stamp").is_file() and (out / "bench-stamp").read_text() == stamp:
        return out
    largest = max(s.nbytes for s in specs)
    gen = torch.Generator().manual_seed(0)
    pool = {torch.int8: torch.randint(-127, 128, (largest,), dtype=torch.int8, generator=gen),
            torch.float32: torch.rand(largest // 4 + 1, generator=gen) * 1e-3 + 1e-5,
            torch.bfloat16: (torch.randn(max(largest // 2, vocab * hidden) + 1, generator=gen) * 0.02).to(torch.bfloat16)}
    t0 = time.perf_counter()
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / WEIGHTS_DIR).mkdir()
        for r in range(TP):
            writer = ShardedSafetensorsWriter(tmp, specs, file_name=rank_file(r))
            for s in specs:
                n = 1
                for d in s.shape:
                    n *= d
                value = (torch.full(s.shape, r, dtype=torch.int32) if s.dtype == torch.int32
                         else pool[s.dtype][:n].view(s.shape))
                writer.write(s.name, value)
            writer.close()
            print(f"  wrote {rank_file(r)}: {writer.total_bytes / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        host = ShardedSafetensorsWriter(tmp, [TensorSpec(EMBED_TENSOR, KEPT_DTYPE, (vocab, hidden))],
                                        file_name=EMBED_FILE)
        host.write(EMBED_TENSOR, pool[torch.bfloat16][:vocab * hidden].view(vocab, hidden))
        host.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        Manifest.build(g, embed_dtype=KEPT_DTYPE, quantize_attention=False,
                       not_exported=["model.vision_tower", "model.embed_vision"],
                       source={"files": {}, "prefix": "model.language_model.", "note": "bench: random values"},
                       memory_plan=None, max_length=serving_max_length(None, g.arch.max_positions)).write(tmp)
        (tmp / "bench-stamp").write_text(stamp)
    print(f"  built {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


# ---------------------------------------------------------------------------------------- cgroup

class MemoryCgroup:
    """A fresh memory cgroup (v2 where mounted, else v1) of ``limit`` bytes, swap off: v1 a child
    of the caller's memory cgroup, v2 a sibling of the caller's (a v2 cgroup with processes cannot
    have children that take controllers); removed by :meth:`close`.

    Raises:
        OSError: no writable memory cgroup hierarchy here (the half-made cgroup removed).
    """

    def __init__(self, limit: int):
        self.dir: Path | None = None
        try:
            self._make(limit)
        except OSError:
            self.close()
            raise

    def _make(self, limit: int) -> None:
        root = Path("/sys/fs/cgroup")
        name = f"g4-bench-inf2-{os.getpid()}-{time.monotonic_ns()}"
        if (root / "cgroup.controllers").is_file():  # v2
            own = Path(open("/proc/self/cgroup").read().strip().split("::", 1)[1].lstrip("/"))
            parent = root / own.parent if own != Path(".") else root
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                raise OSError(f"the memory controller is not enabled for children of {parent}")
            self.v2, self.dir = True, parent / name
            self.dir.mkdir()
            (self.dir / "memory.max").write_text(str(limit))
            if (self.dir / "memory.swap.max").exists():
                (self.dir / "memory.swap.max").write_text("0")
        else:
            own = next(line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup")
                       if line.split(":", 2)[1] == "memory")
            self.v2, self.dir = False, root / "memory" / own.lstrip("/") / name
            self.dir.mkdir()
            (self.dir / "memory.limit_in_bytes").write_text(str(limit))
            if (self.dir / "memory.memsw.limit_in_bytes").exists():
                (self.dir / "memory.memsw.limit_in_bytes").write_text(str(limit))
            (self.dir / "memory.swappiness").write_text("0")
        self.limit = limit

    def join(self) -> None:
        """Move the calling process into the cgroup (a ``preexec_fn``)."""
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        f = self.dir / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) if f.exists() else None

    def oom_kills(self) -> int:
        text = (self.dir / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        return sum(int(v) for k, v in (line.split() for line in text.splitlines()) if k == "oom_kill")

    def close(self) -> None:
        """Remove the cgroup (its processes have exited; retried for 5 s, then said)."""
        if self.dir is None or not self.dir.exists():
            return
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove the cgroup {self.dir}", file=sys.stderr)


def evict(paths: list[Path]) -> None:
    """Drop ``paths`` from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------- child: the load

def _rss() -> dict[str, int]:
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def child(result: Path, report: Path) -> None:
    """Runs inside the cgroup: the deploy's weight hand-over (module docstring), sampled."""
    peaks = {"RssAnon": 0, "RssFile": 0, "Rss": 0}
    phases: dict[str, dict] = {}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            r = _rss()
            peaks["RssAnon"] = max(peaks["RssAnon"], r["RssAnon"])
            peaks["RssFile"] = max(peaks["RssFile"], r["RssFile"])
            peaks["Rss"] = max(peaks["Rss"], r["RssAnon"] + r["RssFile"] + r.get("RssShmem", 0))
            stop.wait(0.02)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    sys.path.insert(0, str(REPO / "tests" / "lanes"))
    from nxd_cpu import stubs

    stubs.install_nxdi(str(NXD_SRC), str(NXDI_SRC))
    os.environ["NXD_CPU_MODE"] = "0"  # the traced module is built in NxD's mocked "xla" group, as on Neuron
    import types

    import torch

    from g4.exporters.neuron_int8 import Manifest
    from g4.serve.neuron_backend import build_nxdi_model, nxdi_settings

    phases["imports"] = {"s": time.perf_counter() - t0, **_rss()}
    settings = nxdi_settings(Manifest.from_dir(result), json.loads((result / "config.json").read_text()),
                             on_cpu=False, dtype="bfloat16")
    model = build_nxdi_model(result, settings)
    phases["model built"] = {"s": time.perf_counter() - t0, **_rss()}
    staging = torch.empty(STAGING_BYTES, dtype=torch.uint8)
    seen = {"bytes": 0, "tensors": 0, "ranks": 0}

    class HostToDevice:  # stands in for NxD's NxDModel (torch.classes.neuron.SPMDModel), Neuron-only
        def initialize(self, weights, start_rank):
            phases["weights handed over"] = {"s": time.perf_counter() - t0, **_rss()}
            for rank_weights in weights:
                for tensor in rank_weights.values():
                    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor.view(torch.uint8)
                    for i in range(0, flat.numel(), STAGING_BYTES):
                        part = flat[i:i + STAGING_BYTES]
                        staging[:part.numel()].copy_(part)
                    seen["bytes"] += flat.numel()
                    seen["tensors"] += 1
                seen["ranks"] += 1
            seen["start_rank"] = int(start_rank[0])

    model.traced_model = types.SimpleNamespace(nxd_model=HostToDevice())
    model.load_weights("unused: the weights come from the result")  # g4_rank_weights -> initialize
    phases["initialized"] = {"s": time.perf_counter() - t0, **_rss()}
    stop.set()
    report.write_text(json.dumps({"peaks": peaks, "phases": phases, "read": seen, "wall_s": time.perf_counter() - t0,
                                  "VmHWM": _rss()["VmHWM"], "settings": settings}, indent=1))


def measure(result: Path, limit: int, work: Path) -> dict:
    """One cold load of ``result`` in a memory cgroup of ``limit`` bytes (module docstring)."""
    from g4.exporters.neuron_int8 import Manifest, rank_file

    files = [result / rank_file(r) for r in range(Manifest.from_dir(result).tp_degree)]
    evict(files)
    report = work / f"measure-{limit}.json"
    report.unlink(missing_ok=True)
    cg = MemoryCgroup(limit)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(OVERLAY), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", str(result), str(report)], env=env,
                              preexec_fn=cg.join, capture_output=True, text=True)
        out = {"limit": limit, "rc": proc.returncode, "wall_s": time.perf_counter() - t0,
               "killed": proc.returncode == -signal.SIGKILL, "oom_kills": cg.oom_kills(),
               "cgroup_peak": cg.peak_bytes(), "stderr": proc.stderr[-2000:]}
    finally:
        cg.close()
    if report.is_file():
        out.update(json.loads(report.read_text()))
    return out


def _g(b) -> str:
    return "-" if b is None else f"{b / GiB:.2f} GiB"


def main() -> int:
    from g4.convert.plan import HOST_RESERVE_BYTES, NEURON_TARGETS

    host_gib, reserve_gib = NEURON_TARGETS[TARGET].host_ram_bytes / GiB, HOST_RESERVE_BYTES / GiB
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=REPO / "bench" / "_work" / "inf2-deploy")
    ap.add_argument("--limit-gib", type=float, nargs="+", default=[host_gib - reserve_gib, 4.0],
                    help=f"memory cgroup limits to load in (default: {host_gib:g} - {reserve_gib:g} GiB, and a tight 4)")
    ap.add_argument("--result", type=Path, help="measure this int8-neuron result (any TP) instead of building one")
    ap.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    for path, what in ((NXD_SRC, "G4_NXD_SRC"), (NXDI_SRC, "G4_NXDI_SRC"), (OVERLAY / "transformers", "G4_NXDI_OVERLAY")):
        if not path.exists():
            print(f"error: {path} not found (set {what}; the overlay is built by pytest tests/lanes/test_nxdi_gemma4.py)",
                  file=sys.stderr)
            return 2
    args.work.mkdir(parents=True, exist_ok=True)
    if args.result:
        from g4.core.errors import G4Error
        from g4.exporters.neuron_int8 import Manifest

        try:
            tp = Manifest.from_dir(args.result).tp_degree
        except G4Error as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        result = args.result
    else:
        print(f"building the real-size TP-{TP} int8-neuron result of gemma-4-26B-A4B in {args.work} (random values)")
        result = build(args.work)
    from g4.exporters.neuron_int8 import rank_file

    tp = tp if args.result else TP
    files = sum((result / rank_file(r)).stat().st_size for r in range(tp))
    print(f"rank files: {files / 1e9:.2f} GB ({files / GiB:.2f} GiB) for {tp} ranks; host RAM of an {TARGET} "
          f"{host_gib:g} GiB, limit = what is left for g4serve's process")
    failed = False
    for gib in args.limit_gib:
        try:
            r = measure(result, int(gib * GiB), args.work)
        except OSError as e:
            print(f"error: cannot create a memory cgroup here ({e}); run as root on a host with cgroups",
                  file=sys.stderr)
            return 2
        ok = r["rc"] == 0 and r.get("read", {}).get("bytes") is not None
        failed |= not ok
        verdict = "completed" if ok else ("OOM-killed" if r["killed"] or r["oom_kills"] else f"failed (rc {r['rc']})")
        print(f"\nlimit {gib:g} GiB: {verdict}; {r['wall_s']:.0f} s; oom_kill events {r['oom_kills']}")
        if not ok:
            print("  " + r["stderr"].strip().replace("\n", "\n  ")[-1500:])
            continue
        p, read = r["peaks"], r["read"]
        print(f"  peak RSS {_g(p['Rss'])} = anonymous {_g(p['RssAnon'])} (peak) + file-backed up to "
              f"{_g(p['RssFile'])}; VmHWM {_g(r['VmHWM'])}; cgroup peak charge {_g(r['cgroup_peak'])}"
              + (f" ({r['cgroup_peak'] / files:.2f}x the rank files)" if r["cgroup_peak"] is not None else ""))
        print(f"  stand-in initialize read {read['bytes'] / 1e9:.2f} GB in {read['tensors']} tensors of "
              f"{read['ranks']} ranks ({read['bytes'] / files:.4f}x the rank files' sizes, headers included)")
        for name, ph in r["phases"].items():
            print(f"  {name:>22}: {ph['s']:6.1f} s, anonymous {_g(ph['RssAnon'])}, file-backed {_g(ph['RssFile'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
