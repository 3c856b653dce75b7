"""The native NVFP4 max kernel (quantizers/nvfp4_native.c, built by g4.quantizers.native): the eager
kernel's bytes on every bf16 block amax under global scales across the whole fp32 range (the
modelopt comparison runs it too: test_nvfp4_quantizer.py's "native" mode), and what happens where
it cannot be built, fails its check, is damaged in the cache or the cache is off."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from helpers import native_nvfp4_kernel, native_nvfp4_or_skip, native_nvfp4_unchecked

from g4.quantizers import compiled, native, nvfp4 as q


# the builds whose bytes are checked: the machine's own (AVX-512 here) and the AVX2 path
BUILDS = {"native": (), "avx2": ("-mno-avx512f",)}


def unchecked(build: str = "native"):
    """:func:`helpers.native_nvfp4_unchecked` with ``build``'s flags."""
    return native_nvfp4_unchecked(BUILDS[build], build)


def fresh(check=None, cflags=None) -> native.NativeKernel:
    """A kernel of the same source, not yet built or loaded in this process."""
    return native_nvfp4_kernel(check, cflags)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "kernels"
    monkeypatch.setenv(compiled.KERNEL_CACHE_ENV, str(root))
    return root


def eager(w: torch.Tensor, g: torch.Tensor, kernel=q._quantize_blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager ``kernel``'s (max's by default) codes and scale bytes of ``w`` ``[rows, in]``."""
    packed, scales = kernel(w.reshape(w.shape[0], -1, q.BLOCK_SIZE), g)
    return packed.view(w.shape[0], -1), scales.view(torch.uint8).view(w.shape[0], -1)


def run(fn, w: torch.Tensor, g: torch.Tensor, threads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scales = q._empty_result(*w.shape)
    q.native_call(fn, w, float(g), packed, scales, threads)
    return packed, scales.view(torch.uint8)


def every_bf16_amax() -> torch.Tensor:
    """One 16-element block per positive finite bf16 value (0x0001..0x7F7F), that value its amax
    (as the first element, negated in every other block), the other 15 elements within it."""
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    frac = torch.rand(amax.numel(), 15, generator=torch.Generator().manual_seed(0)) * 2 - 1
    w = torch.cat([amax[:, None], amax[:, None] * frac], 1).bfloat16()
    w[1::2, 0] *= -1
    assert torch.equal(w.float().abs().amax(1), amax)
    return w


@pytest.mark.parametrize("build", BUILDS)
def test_every_bf16_block_amax_under_global_scales_across_fp32_gives_the_eager_bytes(build):
    """Block scales from E4M3's subnormals (code 1, 2**-9) to 448 and clamped at both ends,
    ties of the E4M3 rounding and of the E2M1 codes: every positive finite bf16 value is a block
    amax, under global scales from 2**-140 to 2**120 (powers of 2 and not); the AVX-512 and the
    AVX2 paths."""
    fn = unchecked(build)
    w = every_bf16_amax()
    for k in range(-140, 121, 10):
        for m in (1.0, 1.37, 1.9921875):
            g = torch.tensor(m * 2.0**k, dtype=torch.float32)
            got, want = run(fn, w, g), eager(w, g)
            assert torch.equal(got[1], want[1]), f"block scales differ under g = {g.item()!r}"
            assert torch.equal(got[0], want[0]), f"codes differ under g = {g.item()!r}"


@pytest.mark.parametrize("build", BUILDS)
def test_e2m1_ties_and_the_thread_split_give_the_same_bytes(build):
    """Values at every E2M1 midpoint (ties to the even code), their bf16 neighbours, -0, and a
    tensor split over 1, 2 and 3 threads (ranges of 16 blocks and a tail)."""
    fn = unchecked(build)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    vals = torch.cat([mids, -mids, torch.tensor([6.0, -6.0, 0.0, -0.0])]).bfloat16()
    near = torch.cat([vals, torch.nextafter(vals.float(), torch.tensor(10.0)).bfloat16(),
                      torch.nextafter(vals.float(), torch.tensor(-10.0)).bfloat16()])
    row = torch.cat([torch.tensor([6.0]).bfloat16(), near])  # amax 6 in each block row
    w = row[torch.randint(0, row.numel(), (777, 48), generator=torch.Generator().manual_seed(1))]
    w[:, ::16] = 6.0  # every block's amax is 6: block scale 448 under g = 6 / 2688, x / (448 g) = x
    g = q.global_scale_from_amax(6.0)
    want = eager(w, g)
    for threads in (1, 2, 3):
        got = run(fn, w, g, threads)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{threads} threads"


@pytest.mark.parametrize("build", BUILDS)
def test_nan_and_inf_give_the_eager_bytes(build):
    """A NaN anywhere in a block gives it E4M3's NaN scale (the float max instructions drop a NaN;
    the kernel's max on the bits keeps it), an Inf the scale 448 and the saturated code, as the
    eager kernel (fake_quantize_activation quantizes activations, which nobody checked)."""
    fn = unchecked(build)
    w = (torch.randn(37, 64, generator=torch.Generator().manual_seed(8)) * 0.02).bfloat16()
    g = q.global_scale_from_amax(q.weight_amax(w))  # before the NaN and Inf go in
    for k, value in enumerate((float("nan"), float("-nan"), float("inf"), float("-inf"))):
        w[k, 3 + 16 * k] = value  # one per block position in a row of four blocks
    w[20, :] = float("nan")
    w[21, 17] = float("inf")
    w[21, 18] = float("nan")
    for threads in (1, 2):
        got, want = run(fn, w, g, threads), eager(w, g)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert (want[1][:2] == 0x7F).any() and (want[1][2:4] == 0x7E).any()


def test_quantize_and_experts_use_it_for_bf16(monkeypatch):
    """quantize / quantize_experts take the native kernel for bf16 weights (a kernel that is not
    called proves it; a strided one through its contiguous copy), and the other kernels otherwise:
    the same bytes."""
    native_nvfp4_or_skip()
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(3, 512, 1024, generator=gen) * 0.02).bfloat16()
    calls = []
    real = q.NATIVE.load()
    monkeypatch.setattr(q.NATIVE, "function", lambda *a: calls.append(a[1]) or real(*a))
    monkeypatch.setattr(q.NATIVE, "min_elements", 0)
    got = q.quantize_experts(w)
    assert calls == [512 * 1024 // 16] * 3
    wide = (torch.randn(64, 2832, generator=gen) * 0.02).bfloat16()
    strided = q.quantize(wide[:, :2816])  # not contiguous: its contiguous copy
    assert len(calls) == 4
    monkeypatch.setattr(q.NATIVE, "function", None)
    monkeypatch.setattr(q.KERNEL, "compiled", None)
    want = q.quantize_experts(w)
    assert torch.equal(got.weight, want.weight) and torch.equal(got.weight_scale_2, want.weight_scale_2)
    assert torch.equal(got.weight_scale.view(torch.uint8), want.weight_scale.view(torch.uint8))
    assert torch.equal(strided.weight, q.quantize(wide[:, :2816].contiguous()).weight)


def test_a_non_finite_global_scale_is_left_to_the_other_kernels(monkeypatch):
    """The C kernel takes finite weights under a finite global scale (a conversion checks its
    inputs first); quantize_experts of an expert holding NaN (its global scale NaN) gives the
    eager bytes for every expert all the same."""
    native_nvfp4_or_skip()
    monkeypatch.setattr(q.NATIVE, "min_elements", 0)
    w = (torch.randn(3, 64, 256, generator=torch.Generator().manual_seed(6)) * 0.02).bfloat16()
    w[1, 3, 5] = float("nan")
    got = q.quantize_experts(w)
    monkeypatch.setattr(q.NATIVE, "function", None)
    monkeypatch.setattr(q.KERNEL, "compiled", None)
    want = q.quantize_experts(w)
    assert torch.equal(got.weight, want.weight)
    assert torch.equal(got.weight_scale.view(torch.uint8), want.weight_scale.view(torch.uint8))


def test_g4_nvfp4_eager_turns_it_off(monkeypatch):
    monkeypatch.setenv("G4_NVFP4_EAGER", "1")
    assert q.NATIVE.for_size(1 << 30) is None


def test_no_compiler_leaves_the_compiled_kernel_with_one_log_line(cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    kernel = fresh()
    with caplog.at_level("INFO", logger="g4.quantizers.native"):
        assert kernel.for_size(1 << 30) is None
        assert kernel.for_size(1 << 30) is None  # once per process
    assert caplog.text.count("NVFP4 max: native kernel unavailable (no C compiler") == 1
    assert not cache.exists()
    monkeypatch.setenv("CC", "false")  # a compiler that refuses the source (as on a CPU without AVX-512 or AVX2)
    with pytest.raises(native.NativeBuildError, match="nvfp4_native.c does not compile here"):
        fresh().save()
    assert not any(cache.iterdir())  # no partial library left


@pytest.mark.parametrize("cc, why", [
    ("g++", None),  # a C++ compiler: -x c keeps the source C (the symbol's name unmangled)
    ("cc -fvisibility=hidden", None),  # the function is exported all the same
    ('cc "', "is not a command"),
    ("true", "wrote no library"),
    ("false", "exited with status 1"),
])
def test_what_a_compiler_does_is_one_log_line_or_a_working_library(cache, monkeypatch, caplog, cc, why):
    """Each $CC either builds a library that gives the eager bytes, or leaves the torch.compile
    kernel with one line naming why (never a traceback out of a conversion)."""
    native_nvfp4_or_skip()
    if not shutil.which(cc.split()[0]):
        pytest.skip(f"no {cc.split()[0]} here")
    monkeypatch.setenv("CC", cc)
    with caplog.at_level("INFO", logger="g4.quantizers.native"):
        fn = fresh().load()
    if why is None:
        assert fn is not None, caplog.text
    else:
        assert fn is None and caplog.text.count("native kernel unavailable") == 1 and why in caplog.text
        assert not cache.exists() or not [p for p in cache.iterdir() if p.suffix == ".so"]


def test_a_group_writable_umask_still_gives_a_library_it_loads(cache):
    """umask 002 (many distributions' default for users) would make the library and its digest
    group-writable, which the cache's rule refuses: they are written 755 and 644."""
    native_nvfp4_or_skip()
    before = os.umask(0o002)
    try:
        path, _ = fresh().save()
    finally:
        os.umask(before)
    assert oct(path.stat().st_mode & 0o777) == "0o755"
    assert oct((cache / (path.name + ".sha256")).stat().st_mode & 0o777) == "0o644"
    assert fresh().load() is not None


def test_a_library_that_sets_flush_to_zero_when_loaded_is_refused_and_undone(cache, monkeypatch, caplog):
    """gcc links a -ffast-math library with code that makes the loading thread flush subnormals to
    zero, which would change the eager and compiled kernels' bytes too: the mode is put back and
    the library is not used."""
    native_nvfp4_or_skip()
    monkeypatch.setenv("CC", "cc -ffast-math")
    assert not native._flushes_subnormals()
    with caplog.at_level("WARNING"):
        fn = fresh().load()
    assert not native._flushes_subnormals()
    if fn is not None:
        pytest.skip("this compiler's -ffast-math does not set flush-to-zero when the library is loaded")
    assert "changed the floating-point mode when loaded" in caplog.text


def test_a_library_that_fails_its_check_is_not_used(cache, caplog):
    native_nvfp4_or_skip()
    kernel = fresh(check=lambda fn: False)
    with caplog.at_level("WARNING"):
        assert kernel.load() is None
    assert "does not give the eager bytes; not used" in caplog.text


def test_the_cache_keeps_it_checks_its_digest_and_its_owner(cache, caplog):
    """Built once into the cache with its sha256 beside it, found there by the next process; a
    damaged library is built again, not loaded; a cache others can write is not loaded."""
    native_nvfp4_or_skip()
    shutil.rmtree(cache, ignore_errors=True)  # where that was the process's first load, it built them here
    path, seconds = fresh().save()
    assert path.parent == cache and seconds is not None and path.suffix == ".so"
    assert fresh().save() == (path, None)
    (cache / (path.name + ".sha256")).write_text("0" * 64 + "\n")
    os.chmod(cache / (path.name + ".sha256"), 0o644)
    assert fresh().save()[1] is not None  # not intact: built again (g4convert kernels says so)
    assert (cache / (path.name + ".sha256")).read_text().strip() == compiled._file_sha256(path)
    assert fresh().load() is not None
    good = path.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    damaged = cache / "damaged.so"
    damaged.write_bytes(bytes(data))
    os.chmod(damaged, 0o755)  # not the umask's: refused as damaged, not as group-writable
    os.replace(damaged, path)  # a new file: the one loaded above stays mapped as it was
    with caplog.at_level("WARNING"):
        assert fresh().load() is not None  # built again, then loaded
    assert "is damaged or incomplete" in caplog.text and path.read_bytes() == good
    caplog.clear()
    os.chmod(path, 0o775)  # others could have written it: replaced by a new build, then loaded
    with caplog.at_level("WARNING"):
        assert fresh().load() is not None
    assert "is not a file only this user can write; building it again" in caplog.text
    assert path.stat().st_mode & 0o777 == 0o755
    caplog.clear()
    os.chmod(cache, 0o777)
    try:
        with caplog.at_level("WARNING"):
            assert fresh().load() is None
    finally:
        os.chmod(cache, 0o700)
    assert "is not a directory only this user can write" in caplog.text


def test_with_the_cache_off_it_is_built_for_the_process(cache, monkeypatch):
    native_nvfp4_or_skip()
    monkeypatch.setenv(compiled.KERNEL_CACHE_ENV, "off")
    kernel = fresh()
    assert kernel.library_path() is None and kernel.load() is not None
    assert not cache.exists()
    with pytest.raises(ValueError, match="the kernel cache is off"):
        kernel.save()


def test_a_weight_only_conversion_with_it_writes_the_eager_bytes(tiny_text, tmp_path, monkeypatch):
    """`nvfp4 --weight-only --algorithm max` of the tiny model with every bf16 linear and expert
    through the native kernel (its size floor lowered, a counter proves it ran) writes the same
    weight files as with the eager kernel alone."""
    from safetensors.torch import load_file

    from g4.convert.nvfp4 import convert_nvfp4

    native_nvfp4_or_skip()
    calls = []
    real = q.NATIVE.load()
    monkeypatch.setattr(q.NATIVE, "function", lambda *a: calls.append(a[1]) or real(*a))
    monkeypatch.setattr(q.NATIVE, "min_elements", 0)
    convert_nvfp4(tiny_text, tmp_path / "native", weight_only=True, algorithm="max", progress=False)
    assert len(calls) > 8
    monkeypatch.setattr(q.NATIVE, "function", None)
    monkeypatch.setattr(q.KERNEL, "compiled", None)
    convert_nvfp4(tiny_text, tmp_path / "eager", weight_only=True, algorithm="max", progress=False)
    files = sorted(p.name for p in (tmp_path / "eager").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "native").glob("*.safetensors"))
    for name in files:
        a, b = load_file(tmp_path / "native" / name), load_file(tmp_path / "eager" / name)
        assert a.keys() == b.keys()
        for k in a:
            x, y = a[k].reshape(-1), b[k].reshape(-1)
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k


def test_the_reason_given_is_the_compilers_own_line():
    out = ("/usr/bin/ld: cannot open output file /c/x.so: Read-only file system\n"
           "collect2: error: ld returned 1 exit status\n")
    assert native._first_line(out) == "/usr/bin/ld: cannot open output file /c/x.so: Read-only file system"
    assert native._first_line("x.c:14:2: error: #error \"needs AVX2\"\n") == 'x.c:14:2: error: #error "needs AVX2"'
    assert native._first_line("") == ""
