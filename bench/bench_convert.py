"""Whole conversion (NVFP4, or int8-neuron at --tp) of a synthetic gemma-4-26B-A4B checkpoint
(real names and shapes, random bf16 weights): seconds per layer, size in/out (per rank for
int8-neuron), projected real-model size, and peak RSS against the bound
2 x largest tensor + 1.5 GiB.

    python bench/bench_convert.py [--layers 2] [--format nvfp4|int8-neuron] [--tp 2]
                                  [--work bench/_work] [--calib-samples 32]

The synthetic source is made once with `g4convert synth` and reused; the converted result is
removed once measured (``--keep-output`` keeps it). The conversion
runs in a child process so its peak RSS (ru_maxrss of that process) is its own.

The I/O floor is measured in the same run, right after the conversion: read every source
file (16 MiB reads, the disk asked for the next 512 MiB ahead of them as the conversion asks
for its tensors, :func:`io_floor_seconds`) and write as many bytes as the conversion wrote to a file on the same
disk, by as many threads as the conversion writes with (``g4.convert.pipeline.WRITE_THREADS``:
on this 2-core machine two threads wrote 5.4 GB of new data 2 to 10 times faster than one in
alternating runs, so a one-thread floor would be no floor; ``--write-threads`` overrides it, e.g.
to measure an older g4 against the same floor); the conversion cannot beat read + write on one
disk. Printed: seconds per layer of both, their ratio (the issue's target is <= 1.3), and both projected to the real model's
bytes (30 layers); and the same floor in direct I/O (:func:`io_floor_direct_seconds`, the disk's own
speed, without the page cache) with the conversion's ratio to it.

Both timed phases start from the same page-cache state (:func:`settle`; then a rest of
``--settle-seconds``, :data:`SETTLE_SECONDS`, for this VM's memory): every dirty page
flushed (``os.sync``), so neither pays for writing back the other's output (the floor used
to run while the conversion's gigabytes were still being written back, which slowed it and
made the ratio look better than it was), and then, with ``--cache cold`` (the default: the
real 26B, 51.6 GB, never fits a 16-24 GiB host's page cache), every source file evicted from
the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file: no root needed, and the
kernel drops the clean pages of that file), so both read the source from the disk; with
``--cache warm`` the source read once untimed, so both read it from the page cache. Neither
phase syncs its own output: both are timed up to their last write (the floor's into the page cache; the
conversion's tensor bytes go to the disk with direct I/O, ``g4.exporters.safetensors_writer``, so it is timed
up to more of its writing than the floor).

Also printed: the bytes the conversion process read from the disk (``ru_inblock`` of the child,
512-byte units: reads from the page cache do not count, the kernel's readahead into it does)
over the source's bytes, i.e. how many times the conversion read its source from the disk (an
NVFP4 W4A4 conversion also reads a layer for its calibration; int8-neuron also hashes the source
files for the manifest), and the bytes of the source still in the page cache when the conversion
has finished (util-linux ``fincore``; the conversion releases what it is done with,
``g4.convert.pipeline.SourceRelease``). Meaningful with ``--cache cold`` only.

Before the timed phases, untimed, ``g4convert kernels`` packages the conversion's quantization
kernels into the per-machine kernel cache (``g4.quantizers.compiled``; 7-17 s per kernel the
first time, then found there), as a user does once per machine: the conversion then loads them in
milliseconds instead of compiling them in its own process (5-8 s before its first layer on this
machine). ``--no-kernel-cache`` measures the conversion without it (``G4_KERNEL_CACHE=off``:
torch.compile in the process, with inductor's own on-disk cache as warm as earlier runs left it).

Also printed: the conversion's CPU seconds in user and in kernel (sys) mode. The kernel's share
depends on the machine's memory, not only on g4: on this CI's VM, freshly booted (its memory
returned to the host while free: virtio-balloon free page reporting), the first touch of each
page costs the host a fault (20 GiB touched once: 62 s), and the page cache's and the process's
new pages pay it. Measured there on 2026-12-06, cold 2-layer ``int8-neuron --tp 2``: 12.0-16.5
user and 3.5-13.1 sys CPU seconds, 9.9-16.9 s; a buffered read of a cold 4.4 GB file 0.48-0.62
GB/s before 20 GiB had been touched and 1.8 GB/s after, an ``O_DIRECT`` one (no new pages) 1.4-1.6
GB/s throughout. The direct floor pays none of it; the buffered floor and the conversion do.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 2**30


# Seconds settle() waits once the cache is settled (--settle-seconds). This machine is a VM with
# free page reporting (virtio_balloon): memory freed is handed back to the host about 2 s later,
# and its next use faults it in from the host again (touching 2 GiB of fresh anonymous memory took
# 6.2 s here, 1.6-2.4 s when it was reused soon after being freed). Measured 2026-12-04 on the
# 2-layer synthetic: the floor 6.0-12.1 s started at once after an eviction, 11.8-12.8 s
# started 6 s after it, three runs each, alternated: waiting puts both timed phases in the same
# state (the slower one) instead of whichever memory the previous step happened to free.
SETTLE_SECONDS = 6.0


def settle(src: Path, cache: str = "cold", wait_s: float = SETTLE_SECONDS) -> None:
    """Bring the page cache to the state both timed phases start from: nothing dirty
    (``os.sync``), then every source file evicted (``cold``: ``POSIX_FADV_DONTNEED``) or read
    once (``warm``), then ``wait_s`` seconds of rest (:data:`SETTLE_SECONDS`)."""
    os.sync()
    buf = bytearray(16 << 20)
    for f in sorted(src.rglob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            if cache == "cold":
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                continue
            while fh.readinto(buf):
                pass
    time.sleep(wait_s)


def cached_bytes(root: Path) -> int | None:
    """Bytes of the ``*.safetensors`` files under ``root`` now in the page cache (util-linux
    ``fincore``), or None without it."""
    files = sorted(str(f) for f in root.rglob("*.safetensors"))
    try:
        res = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum(int(x) for x in res.stdout.split())


def disk_read_bytes(before: resource.struct_rusage, after: resource.struct_rusage) -> int:
    """Bytes read from block devices between two ``getrusage`` samples (``ru_inblock`` counts
    512-byte units; page-cache hits are not counted)."""
    return (after.ru_inblock - before.ru_inblock) * 512


def io_floor_seconds(src: Path, nbytes_out: int, work: Path, threads: int) -> float:
    """Seconds to read every file under ``src`` and then write ``nbytes_out`` bytes into ``work``
    (same disk as the conversion's output), in 16 MiB pieces, read with the disk asked for the
    next :data:`g4.convert.pipeline.DISK_AHEAD_BYTES` ahead of the reads in the conversion's
    readahead pieces (many reads in flight: 1.25-1.6x faster than 16 MiB reads alone, cold, on
    this machine's disk), written by ``threads`` threads at once (positioned writes into one
    file, as the conversion's writer threads do); the scratch file is removed."""
    from g4.convert.pipeline import DISK_AHEAD_BYTES, FileAdvice

    chunk = 16 << 20
    buf = bytearray(chunk)
    advice = FileAdvice()
    t = time.perf_counter()
    for f in sorted(src.rglob("*.safetensors")):
        size, asked, at = f.stat().st_size, 0, 0
        with open(f, "rb", buffering=0) as fh:
            while True:  # the disk asked for the next DISK_AHEAD_BYTES, as the conversion asks for them
                while asked < min(size, at + DISK_AHEAD_BYTES):
                    advice.willneed(f, asked, 64 << 20)
                    asked += 64 << 20
                if not (n := fh.readinto(buf)):
                    break
                at += n
    advice.close()
    scratch = work / "_io_floor.bin"
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    per = -(-nbytes_out // threads)

    def write(i: int) -> None:
        at, end = i * per, min((i + 1) * per, nbytes_out)
        while at < end:
            at += os.pwrite(fd, memoryview(buf)[: min(chunk, end - at)], at)

    pool = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    seconds = time.perf_counter() - t
    os.close(fd)
    scratch.unlink()
    return seconds


def io_floor_direct_seconds(src: Path, nbytes_out: int, work: Path, threads: int) -> float | None:
    """:func:`io_floor_seconds` with both phases in direct I/O (``O_DIRECT``: the disk reads into
    and writes from this process's reused, page-aligned 16 MiB buffers, the page cache bypassed),
    or None where the file system refuses ``O_DIRECT``. On this VM a page-cache page costs its
    first touch from the host (``dd`` of 16 MiB blocks, 2026-12-04: cold reads 0.66 GB/s buffered,
    1.6 GB/s direct; writes of new data 0.43 GB/s buffered, 1.9-2.7 GB/s direct), so this is the
    disk's own speed, the stricter floor; the conversion reads through the page cache (mmap views
    of the source) and writes its tensor bytes with ``O_DIRECT`` (``g4.exporters.safetensors_writer``),
    so this is the fair floor for it."""
    import mmap

    chunk = 16 << 20
    bufs = [mmap.mmap(-1, chunk) for _ in range(max(threads, 1))]  # page-aligned, as O_DIRECT needs
    t = time.perf_counter()
    try:
        for f in sorted(src.rglob("*.safetensors")):
            fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
            try:
                while os.readv(fd, [bufs[0]]) == chunk:
                    pass
            finally:
                os.close(fd)
    except OSError:  # EINVAL: no O_DIRECT on this file system (tmpfs, some FUSE)
        return None
    scratch = work / "_io_floor_direct.bin"
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
    blocks = -(-nbytes_out // chunk)
    per = -(-blocks // threads)

    def write(i: int) -> None:
        for b in range(i * per, min((i + 1) * per, blocks)):
            os.pwritev(fd, [bufs[i]], b * chunk)  # whole blocks: the last is cut back below

    pool = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    os.ftruncate(fd, nbytes_out)
    seconds = time.perf_counter() - t
    os.close(fd)
    scratch.unlink()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(__file__).parent / "_work")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--weight-only", action="store_true")
    ap.add_argument("--algorithm", default=None, help="nvfp4 --algorithm (default: g4convert's default)")
    ap.add_argument("--format", choices=["nvfp4", "int8-neuron"], default="nvfp4")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--target", default=None,
                    help="int8-neuron --target (default: the first of g4.convert.plan.NEURON_TARGETS with --tp NeuronCores)")
    ap.add_argument("--cache", choices=["cold", "warm"], default="cold",
                    help="the source's page-cache state at the start of each timed phase (module docstring)")
    ap.add_argument("--settle-seconds", type=float, default=SETTLE_SECONDS,
                    help="rest after the page cache is settled, before each timed phase (SETTLE_SECONDS)")
    ap.add_argument("--keep-output", action="store_true",
                    help="keep the converted result in --work (by default it is removed once measured: "
                         "7-12 GB each at 10 layers)")
    ap.add_argument("--write-threads", type=int, default=None,
                    help="threads writing the floor's bytes (default: g4.convert.pipeline.WRITE_THREADS)")
    ap.add_argument("--no-kernel-cache", action="store_true",
                    help="run the conversion with G4_KERNEL_CACHE=off (its kernels compiled in its own process)")
    args = ap.parse_args()
    from g4.convert.synth import synthetic_config, synthetic_specs

    src = args.work / f"synth-26b-{args.layers}L"
    out = args.work / f"synth-26b-{args.layers}L-{args.format}"
    args.work.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "g4.convert.cli", "-q", "synth", "--layers", str(args.layers), str(src)],
                       check=True)
        print(f"synth: {time.perf_counter() - t:.1f} s")
    shutil.rmtree(out, ignore_errors=True)
    if args.format == "nvfp4":
        call = (f"from g4.convert.nvfp4 import convert_nvfp4; r = convert_nvfp4({str(src)!r}, {str(out)!r}, "
                f"calib_samples={args.calib_samples}, calib_seq_len={args.calib_seq_len}, "
                f"weight_only={args.weight_only}, progress=False"
                + (f", algorithm={args.algorithm!r}" if args.algorithm else "") + "); out_bytes = r.bytes_out")
    else:
        from g4.convert.plan import NEURON_TARGETS

        # default: the first target (smallest first) with a NeuronCore per TP rank
        target = args.target or next(n for n, t in NEURON_TARGETS.items() if t.neuron_cores >= args.tp)
        call = (f"from g4.convert.int8_neuron import convert_int8_neuron; r = convert_int8_neuron({str(src)!r}, "
                f"{str(out)!r}, tp={args.tp}, target={target!r}, progress=False); out_bytes = r.bytes_per_rank[0]")
    cmd = [sys.executable, "-c", f"import sys; {call}; print(r.summary(), file=sys.stderr); "
           "print(r.seconds, r.bytes_in, out_bytes, r.peak_rss_bytes)"]
    env = dict(os.environ)
    if args.no_kernel_cache:
        env["G4_KERNEL_CACHE"] = "off"
    else:  # once per machine, untimed (module docstring)
        kernels = [sys.executable, "-m", "g4.convert.cli", "-q", "kernels", str(src), "--format", args.format]
        if args.format == "int8-neuron":
            kernels += ["--tp", str(args.tp)]
        elif args.algorithm:
            kernels += ["--algorithm", args.algorithm]
        t = time.perf_counter()
        listed = subprocess.run(kernels, check=True, capture_output=True, text=True).stdout.strip().splitlines()
        print(f"g4convert kernels (untimed, {time.perf_counter() - t:.1f} s): "
              f"{sum(line.startswith('compiled') for line in listed)} compiled, "
              f"{sum(line.startswith('in the cache') for line in listed)} in the cache")
    settle(src, args.cache, args.settle_seconds)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    seconds, bytes_in, bytes_out, rss = (float(x) for x in res.stdout.split())
    left_cached = cached_bytes(src)  # the source's pages the conversion left in the page cache
    print(res.stderr.strip().splitlines()[-1])
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    settle(src, args.cache, args.settle_seconds)
    if args.write_threads is None:
        from g4.convert.pipeline import WRITE_THREADS as threads
    else:
        threads = args.write_threads
    floor = io_floor_seconds(src, written, args.work, threads)
    settle(src, args.cache, args.settle_seconds)
    direct = io_floor_direct_seconds(src, written, args.work, threads)
    real_in = sum(s.nbytes for s in synthetic_specs(synthetic_config("gemma-4-26B-A4B")))
    print(json.dumps({"layers": args.layers, "format": args.format, "weight_only": args.weight_only,
                      "source_cache": args.cache,
                      "kernel_cache": "off" if args.no_kernel_cache else "used",
                      "seconds_per_layer": round(seconds / args.layers, 2),
                      "io_floor_seconds_per_layer (read src + write out)": round(floor / args.layers, 2),
                      "ratio_to_io_floor": round(seconds / floor, 2),
                      "direct_io_floor_seconds_per_layer (O_DIRECT read src + write out)":
                          None if direct is None else round(direct / args.layers, 2),
                      "ratio_to_direct_io_floor": None if direct is None else round(seconds / direct, 2),
                      # CPU seconds of the conversion process (user + sys) per wall second, of
                      # os.cpu_count(): near the core count, the conversion is bound by the CPU, not the disk
                      "cores_busy (cpu s / wall s)": f"{cpu / wall:.2f} of {os.cpu_count()}",
                      # of which in the kernel: page faults, page-cache reads and allocation (see
                      # the module's docstring on a freshly booted VM), direct writes
                      "cpu_seconds (user, sys)": [round(after.ru_utime - before.ru_utime, 1),
                                                  round(after.ru_stime - before.ru_stime, 1)],
                      "read_from_disk_GB": round(disk_read_bytes(before, after) / 1e9, 3),
                      "source_GB": round(bytes_in / 1e9, 3),
                      "source_reads_from_disk": round(disk_read_bytes(before, after) / bytes_in, 2),
                      "source_left_in_page_cache_GB": None if left_cached is None else round(left_cached / 1e9, 3),
                      "projected_real_26B_seconds": round(seconds * real_in / bytes_in),
                      "projected_real_26B_io_floor_seconds": round(floor * real_in / bytes_in)}, indent=2))
    try:
        _print_sizes(args, src, out, seconds, bytes_in, bytes_out, rss)
    finally:
        if not args.keep_output:
            shutil.rmtree(out, ignore_errors=True)


def _print_sizes(args, src: Path, out: Path, seconds: float, bytes_in: float, bytes_out: float, rss: float) -> None:
    """The sizes in and out, the projection to the real 26B and peak RSS against its bound."""
    from g4.core.checkpoint import Checkpoint
    from g4.convert.synth import synthetic_config, synthetic_specs

    if args.format == "int8-neuron":
        print(json.dumps({"layers": args.layers, "tp": args.tp, "seconds_total": round(seconds, 1),
                          "bytes_per_rank_GB": round(bytes_out / 1e9, 3),
                          "peak_rss_GiB": round(rss / GIB, 3),
                          "rss_bound_GiB (2 x largest + 1.5)": round((2 * max(i.nbytes for i in Checkpoint(src).tensors.values()) + 1.5 * GIB) / GIB, 3)},
                         indent=2))
        return

    ck = Checkpoint(src)
    largest = max(i.nbytes for i in ck.tensors.values())
    layer_in = sum(i.nbytes for n, i in ck.tensors.items() if n.startswith(ck.layer_prefix(0)))
    nonlayer_in = sum(i.nbytes for n, i in ck.tensors.items() if ".layers." not in n or "vision_tower" in n)
    nonlayer_out = nonlayer_in  # embeddings, norm and vision tower are copied unchanged
    out_ck = Checkpoint(out)
    layer_out = sum(i.nbytes for n, i in out_ck.tensors.items() if n.startswith(out_ck.layer_prefix(0)))
    real = synthetic_config("gemma-4-26B-A4B")
    n_real = real["text_config"]["num_hidden_layers"]
    real_in = sum(s.nbytes for s in synthetic_specs(real))
    real_out = nonlayer_out + n_real * layer_out
    bound = 2 * largest + 1.5 * GIB
    print(json.dumps({
        "layers": args.layers,
        "seconds_total": round(seconds, 1),
        "seconds_per_layer_incl_fixed_costs": round(seconds / args.layers, 1),
        "size_in_GB": round(bytes_in / 1e9, 3),
        "size_out_GB": round(bytes_out / 1e9, 3),
        "out_over_in": round(bytes_out / bytes_in, 4),
        "sliding_layer_in_GB": round(layer_in / 1e9, 4),
        "sliding_layer_out_GB": round(layer_out / 1e9, 4),
        "projected_real_26B_in_GB": round(real_in / 1e9, 2),
        "projected_real_26B_out_GB": round(real_out / 1e9, 2),
        "largest_tensor_GiB": round(largest / GIB, 3),
        "peak_rss_GiB": round(rss / GIB, 3),
        "rss_bound_GiB (2 x largest + 1.5)": round(bound / GIB, 3),
        "rss_within_bound": rss <= bound,
    }, indent=2))


if __name__ == "__main__":
    main()
