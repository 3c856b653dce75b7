"""The per-machine kernel cache (g4.quantizers.compiled: CompiledKernel.save_packages, the package
loaded in a later process): the packaged kernel gives the eager bytes without importing dynamo, and
a package that is not this kernel's, or lies in a directory others can write, is not used."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from g4.quantizers import compiled, nvfp4 as q


def _need_a_compiler():
    """Skip where inductor has no C++ compiler to build a package with (a fresh machine without one)."""
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
        pytest.skip("no C++ compiler: AOTInductor cannot package a kernel here")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A kernel cache holding the NVFP4 max kernel's package for bf16 weights (every width folds
    to [blocks / 4, 4, 16]: one package)."""
    root = tmp_path_factory.mktemp("kernels")
    os.chmod(root, 0o700)
    before = os.environ.get(compiled.KERNEL_CACHE_ENV)
    os.environ[compiled.KERNEL_CACHE_ENV] = str(root)
    loaded, native = q.KERNEL._packages, q.NATIVE.function
    q.KERNEL._packages = {}  # the packages this module loads stay out of the other tests' kernel
    q.NATIVE.function = None  # bf16 max runs the packaged kernel, not the native one (test_nvfp4_native.py)
    try:
        _need_a_compiler()
        umask = os.umask(0o002)  # many distributions' default: the package must not come out group-writable
        try:
            done = q.save_kernels([(2048, 1024, torch.bfloat16)], "max")
        finally:
            os.umask(umask)
        assert [p.parent for p, _ in done] == [root] and done[0][1] is not None
        assert {oct(p.stat().st_mode & 0o777) for p in (done[0][0], done[0][0].with_name(done[0][0].name + ".sha256"))
                } == {"0o644"}
        assert q.save_kernels([(256, 4096, torch.bfloat16)], "max") == [(done[0][0], None)]  # found, not rebuilt
        yield root, done[0][0]
    finally:
        q.KERNEL._packages, q.NATIVE.function = loaded, native
        if before is None:
            os.environ.pop(compiled.KERNEL_CACHE_ENV)
        else:
            os.environ[compiled.KERNEL_CACHE_ENV] = before


LATER_PROCESS = textwrap.dedent("""
    import sys, torch
    from g4.quantizers import nvfp4 as q
    q.NATIVE.function = None  # the packaged kernel, not the native one
    q.warm([(512, 2048, torch.bfloat16)], "max").join()
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(2, 512, 2048, generator=gen) * 0.02).bfloat16()
    w[0, :, 5] = 0.75  # a large value per row
    w[1, 3] = 0
    d = (torch.randn(1024, 1088, generator=gen) * 0.02).bfloat16()  # 68 blocks a row: folded
    got = q.quantize_experts(w), q.quantize(d)
    dynamo = "torch._dynamo" in sys.modules
    q.KERNEL.compiled = None  # the eager chunks
    want = q.quantize_experts(w), q.quantize(d)
    same = all(torch.equal(a.weight, b.weight) and torch.equal(a.weight_scale.view(torch.uint8),
               b.weight_scale.view(torch.uint8)) for a, b in zip(got, want))
    print("dynamo" if dynamo else "no-dynamo", "same" if same else "differ", len(q.KERNEL._packages))
""")


def test_a_later_process_loads_the_package_without_dynamo_and_gets_the_eager_bytes(cache):
    root, _ = cache
    env = dict(os.environ, **{compiled.KERNEL_CACHE_ENV: str(root)})
    res = subprocess.run([sys.executable, "-c", LATER_PROCESS], capture_output=True, text=True, env=env, check=True)
    assert res.stdout.split() == ["no-dynamo", "same", "1"], res.stderr[-2000:]


def test_another_kernels_package_is_refused_and_the_bytes_stay_right(cache, monkeypatch, caplog):
    """A package under the mse kernel's name holding the max kernel (a planted mix-up): its bytes
    differ from the mse kernel's on the probe, so it is not used."""
    root, path = cache
    x = torch.zeros(64, 4, 16, dtype=torch.bfloat16)
    g = torch.ones(())
    wrong = q.MSE_KERNEL.package_path(q.MSE_KERNEL._signature(x, (g,)))
    assert wrong != path and wrong.parent == root
    shutil.copy(path, wrong)
    shutil.copy(f"{path}.sha256", f"{wrong}.sha256")  # intact, only not this kernel's
    monkeypatch.setattr(q.MSE_KERNEL, "_packages", {})
    monkeypatch.setattr(q.MSE_KERNEL, "compiled", None)  # eager, once the package is refused
    w = (torch.randn(256, 64, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    blocks = w.reshape(-1, 4, 16)
    with caplog.at_level("WARNING"):
        package = q.MSE_KERNEL._package(blocks, (g,))
    assert package is None
    assert f"kernel cache package {wrong} does not give the eager bytes; not used" in caplog.text
    monkeypatch.setattr(q.KERNEL, "_packages", {})
    assert q.KERNEL._package(blocks, (g,)) is not None  # the same file under its own name is used


def test_a_cache_others_can_write_is_not_loaded(cache, monkeypatch, caplog):
    root, _ = cache
    monkeypatch.setattr(q.KERNEL, "_packages", {})
    x = torch.zeros(64, 4, 16, dtype=torch.bfloat16)
    os.chmod(root, 0o777)
    try:
        with caplog.at_level("WARNING"):
            assert q.KERNEL._package(x, (torch.ones(()),)) is None
    finally:
        os.chmod(root, 0o700)
    assert f"kernel cache {root} is not a directory only this user can write" in caplog.text
    os.chmod(root, 0o770)
    try:
        with pytest.raises(PermissionError, match="no one else can write"):
            q.save_kernels([(2048, 1024, torch.bfloat16)], "max")
    finally:
        os.chmod(root, 0o700)


def test_the_package_name_depends_on_the_kernel_the_source_and_the_signature(monkeypatch):
    x = torch.zeros(8, 4, 16, dtype=torch.bfloat16)
    g = (torch.ones(()),)
    p = q.KERNEL.package_path(q.KERNEL._signature(x, g))
    assert p.suffix == ".pt2"
    assert q.KERNEL.package_path(q.KERNEL._signature(x.float(), g)) != p  # dtype
    assert q.KERNEL.package_path(q.KERNEL._signature(x.reshape(16, 2, 16), g)) != p  # shape
    assert q.MSE_KERNEL.package_path(q.MSE_KERNEL._signature(x, g)) != p  # another function
    monkeypatch.setattr(compiled, "_machine_digest", lambda: "another torch or CPU")
    assert q.KERNEL.package_path(q.KERNEL._signature(x, g)) != p
    monkeypatch.undo()
    edited = compiled.CompiledKernel(q._quantize_blocks, eager_env="X", label="NVFP4", sources=(compiled.CompiledKernel,))
    assert edited.package_path(edited._signature(x, g)) != p  # more source: another digest
    monkeypatch.setenv(compiled.KERNEL_CACHE_ENV, "off")
    assert q.KERNEL.package_path(q.KERNEL._signature(x, g)) is None
    with pytest.raises(ValueError, match="the kernel cache is off"):
        q.save_kernels([(2048, 1024, torch.bfloat16)], "max")


def test_g4convert_kernels_says_what_it_did_and_refuses_bad_options(monkeypatch):
    from helpers import g4convert, one_error_line

    r = g4convert("kernels")  # the embedded tiny model: every tensor runs eagerly
    assert r.exit_code == 0 and "no kernel to compile" in r.output, r.output
    one_error_line(g4convert("kernels", "--format", "int8-neuron", "--algorithm", "mse"),
                   "--algorithm 'mse' is not one of int8-neuron's: max, gptq")
    # another format's options name no kernel of this one (they were silently ignored)
    one_error_line(g4convert("kernels", "--tp", "4"), "--tp is not an option of nvfp4's conversion")
    one_error_line(g4convert("kernels", "--quantize-attention"),
                   "--quantize-attention is not an option of nvfp4's conversion")
    one_error_line(g4convert("kernels", "--format", "int8-neuron", "--preset", "mlp-only"),
                   "--preset is not an option of int8-neuron's conversion")
    monkeypatch.setenv(compiled.KERNEL_CACHE_ENV, "off")
    one_error_line(g4convert("kernels"), "the kernel cache is off (G4_KERNEL_CACHE=off)")


def test_ctrl_c_in_g4convert_kernels_does_not_speak_of_an_out(monkeypatch):
    """``g4convert kernels`` has no OUT: its interrupt message does not say OUT was left untouched."""
    import signal

    from helpers import g4convert

    from g4.convert import nvfp4
    from g4.core.errors import signal_received

    monkeypatch.setattr(nvfp4, "save_kernels", lambda *a, **k: os.kill(os.getpid(), signal.SIGINT))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        r = g4convert("kernels")
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert r.exit_code == 130 and "interrupted; nothing partial was left" in r.output and "OUT" not in r.output
    # handled: this process's next conversion is not stopped by the old signal (it stopped CI's run)
    assert signal_received() is None


def test_an_int8_layout_kernel_package_gives_every_ranks_bytes(tmp_path, monkeypatch):
    """int8-neuron's experts are quantized straight into every TP rank's layout; their packaged
    kernel (dynamic in the experts) gives the eager bytes for another expert count."""
    from g4.exporters.neuron_int8 import EXPERT_GATE_UP, RankMajor
    from g4.quantizers import int8

    os.chmod(tmp_path, 0o700)
    monkeypatch.setenv(compiled.KERNEL_CACHE_ENV, str(tmp_path))
    layout = RankMajor(EXPERT_GATE_UP, 2)
    kernel = int8._layout_kernel(layout)
    monkeypatch.setattr(kernel, "min_elements", 0)
    monkeypatch.setattr(kernel, "_packages", {})
    _need_a_compiler()
    done = int8.save_kernels([], [(layout, (4, 256, 96), torch.bfloat16)])
    assert len(done) == 1 and done[0][0].name.startswith("int8-layout-")
    w = (torch.randn(6, 256, 96, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    w[1, :, 4] = 0.5  # half-way points after scaling
    monkeypatch.setattr(kernel, "compiled", _no_compile)  # the package or nothing
    got = int8.quantize_to_layout(w, layout)
    assert kernel.compiled is _no_compile  # not disabled: the package ran
    ref = int8.quantize(w)
    want = layout(ref.weight)
    assert torch.equal(got.weight, want) and torch.equal(got.scale, ref.scale)


def _no_compile(*args):
    raise AssertionError("the packaged kernel should have run, not torch.compile")


def test_a_damaged_package_is_never_loaded(cache, monkeypatch, caplog):
    """A package whose bytes are not those recorded when it was compiled is refused before PyTorch's
    loader runs it: damaged machine code killed the process (SIGILL, SIGSEGV) before the probe."""
    root, path = cache
    damaged = root / "damaged"
    damaged.mkdir(mode=0o700)
    x = torch.zeros(64, 4, 16, dtype=torch.bfloat16)
    g = (torch.ones(()),)
    monkeypatch.setenv(compiled.KERNEL_CACHE_ENV, str(damaged))
    target = q.KERNEL.package_path(q.KERNEL._signature(x, g))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    os.chmod(target, 0o644)  # not the umask's: refused as damaged, not as group-writable
    shutil.copy(f"{path}.sha256", f"{target}.sha256")

    def loader(*args):
        raise AssertionError("a damaged package reached PyTorch's loader")

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", loader)
    monkeypatch.setattr(q.KERNEL, "_packages", {})
    with caplog.at_level("WARNING"):
        assert q.KERNEL._package(x, g) is None
    assert f"kernel cache package {target} is damaged or incomplete" in caplog.text
    target.write_bytes(path.read_bytes())  # intact, but without its recorded digest
    os.chmod(target, 0o644)
    os.unlink(f"{target}.sha256")
    monkeypatch.setattr(q.KERNEL, "_packages", {})
    assert q.KERNEL._package(x, g) is None
    os.symlink(path, damaged / "link.pt2")  # a link, or a file others can write, is not loaded either
    os.replace(damaged / "link.pt2", target)
    shutil.copy(f"{path}.sha256", f"{target}.sha256")
    monkeypatch.setattr(q.KERNEL, "_packages", {})
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert q.KERNEL._package(x, g) is None
    assert "is not a file only this user can write" in caplog.text


def test_an_interrupted_package_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """Ctrl-C between the package's compile and its rename into place (here: at the first
    rename) leaves neither the partial package nor its partial digest in the cache (a fresh
    user's trial found the digest left behind)."""
    import torch._inductor
    import torch.export

    os.chmod(tmp_path, 0o700)
    monkeypatch.setenv(compiled.KERNEL_CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(q.KERNEL, "_packages", {})
    monkeypatch.setattr(q.NATIVE, "function", None)  # the package's files, not the native library's
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: None)  # no compile: the files are what counts
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda exported, package_path: open(package_path, "wb").write(b"package"))

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(compiled.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        q.save_kernels([(2048, 1024, torch.bfloat16)], "max")
    assert list(tmp_path.iterdir()) == []
