"""CPU engines: the KV-cache loop against full recomputation, stop ids, formats."""

import pytest
import torch
from serve_fixtures import cpu_engine

from g4.convert.embedded_model import EMBEDDED_DIR
from g4.serve.chat import render_prompt
from g4.serve.engine import HFEngine, SamplingParams, load_cpu_engine


@pytest.fixture(scope="module")
def bf16_engine():
    return load_cpu_engine(EMBEDDED_DIR, dtype="float32")  # the source itself is servable


def test_kv_cache_matches_full_recompute_past_the_sliding_window(bf16_engine):
    e = bf16_engine
    assert isinstance(e, HFEngine) and e.stop_ids == {1, 106, 50} and e.max_context == 2048
    text = " ".join(["Paris is the capital of France."] * 12) + " What is the capital of France?"
    prompt = render_prompt(e.tokenizer, [{"role": "user", "content": text}])
    assert len(prompt) > 64  # beyond the sliding window of the sliding layers
    stop_ids, e.stop_ids = e.stop_ids, frozenset()  # run on past the end of turn
    try:
        got = list(e.generate(prompt, SamplingParams(max_tokens=24)))
    finally:
        e.stop_ids = stop_ids
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(24):
            want.append(int(e.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(want[-1])
    assert got == want


def test_generation_stops_at_a_stop_id_and_at_max_tokens(bf16_engine):
    e = bf16_engine
    prompt = render_prompt(e.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    ids = list(e.generate(prompt, SamplingParams(max_tokens=16)))
    assert e.tokenizer.decode(ids) == "Paris<turn|>"
    assert list(e.generate(prompt, SamplingParams(max_tokens=1))) == ids[:1]
    cancelled = list(e.generate(prompt, SamplingParams(max_tokens=16), should_stop=lambda: True))
    assert cancelled == ids[:1]


def test_engines_of_both_converted_formats():
    nv, i8 = cpu_engine("nvfp4"), cpu_engine("int8-neuron")
    assert "W4A4 activation emulation" in nv.description
    assert "TP=2 emulated" in i8.description
    for e in (nv, i8):
        prompt = render_prompt(e.tokenizer, [{"role": "user", "content": "Who wrote Hamlet?"}])
        assert e.tokenizer.decode(list(e.generate(prompt, SamplingParams(max_tokens=8)))) == "Shakespeare<turn|>"


def test_act_quant_needs_input_scales(tmp_path):
    import json
    import shutil

    from g4.core.errors import CheckpointError
    from serve_fixtures import embedded_result

    w4a16 = tmp_path / "w4a16"
    shutil.copytree(embedded_result("nvfp4"), w4a16)
    from safetensors.torch import load_file, save_file

    sd = {k: v for k, v in load_file(w4a16 / "model.safetensors").items() if not k.endswith(".input_scale")}
    save_file(sd, w4a16 / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((w4a16 / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g.pop("input_activations")
    (w4a16 / "config.json").write_text(json.dumps(cfg))
    e = load_cpu_engine(w4a16)  # auto: weight-only arithmetic for a W4A16 result
    assert "weight-only arithmetic" in e.description
    with pytest.raises(CheckpointError, match="needs input_scale"):
        load_cpu_engine(w4a16, act_quant=True)


def test_end_of_turn_is_a_stop_id_even_without_generation_config(tmp_path, caplog):
    import shutil

    src = shutil.copytree(EMBEDDED_DIR, tmp_path / "src")
    (src / "generation_config.json").unlink()
    with caplog.at_level("WARNING"):
        e = load_cpu_engine(src, dtype="float32")
    assert 106 in e.stop_ids and "lack <turn|>" in caplog.text


def test_streamed_engine_generates_what_the_whole_model_engine_generates(monkeypatch):
    """The layer-at-a-time engine (picked when the whole model would not fit) gives the whole-model
    engine's ids on the W4A4 result (activation emulation on) past the sliding window, and stops alike."""
    from serve_fixtures import embedded_result

    import g4.serve.engine as engine
    from g4.serve.engine import StreamedEngine, whole_model_fits

    out = embedded_result("nvfp4")
    assert whole_model_fits(out, torch.bfloat16)  # 3 MB here
    whole = load_cpu_engine(out, dtype="float32")
    monkeypatch.setattr(engine, "whole_model_fits", lambda path, dtype: False)  # a host too small for it
    streamed = load_cpu_engine(out, dtype="float32")
    assert isinstance(streamed, StreamedEngine) and "W4A4 activation emulation" in streamed.description
    text = " ".join(["Paris is the capital of France."] * 12) + " What is the capital of France?"
    for content, n in ((text, 10), ("Who wrote Hamlet?", 8)):
        prompt = render_prompt(whole.tokenizer, [{"role": "user", "content": content}])
        want = list(whole.generate(prompt, SamplingParams(max_tokens=n)))
        assert list(streamed.generate(prompt, SamplingParams(max_tokens=n))) == want
    assert whole.tokenizer.decode(want) == "Shakespeare<turn|>"
    assert isinstance(load_cpu_engine(out, stream=False), HFEngine)


def test_int8_result_runs_a_layer_at_a_time_when_its_rank_files_do_not_fit(monkeypatch):
    """Issue 24: the int8-neuron emulator is chosen by the same rule as the NVFP4 engines
    (whole_model_fits): whole when the rank files' tensors as stored plus one rank's fp32 lm_head
    slice fit the available memory, otherwise reading one layer at a time; both give the same
    logits bit for bit and the same ids."""
    from safetensors.torch import load_file
    from serve_fixtures import embedded_result

    import g4.serve.engine as engine
    from g4.exporters.neuron_int8 import rank_file
    from g4.serve.engine import EmulatorEngine, whole_model_bytes

    out = embedded_result("int8-neuron")
    ranks = [load_file(out / rank_file(r)) for r in range(2)]
    held = sum(t.nbytes for sd in ranks for n, t in sd.items() if n != "embed_tokens.weight" and not n.endswith(".rank"))
    need = held + ranks[0]["lm_head.weight"].numel() * 4
    assert whole_model_bytes(out, torch.float32) == need
    monkeypatch.setattr(engine, "available_memory_bytes", lambda: need)
    whole = load_cpu_engine(out)
    monkeypatch.setattr(engine, "available_memory_bytes", lambda: need - 1)
    streamed = load_cpu_engine(out)
    assert isinstance(streamed, EmulatorEngine) and streamed.emulator.stream and not whole.emulator.stream
    assert "one decoder layer at a time" in streamed.description and "one decoder" not in whole.description
    prompt = render_prompt(whole.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([prompt])
    assert torch.equal(streamed.emulator(ids), whole.emulator(ids))
    want = list(whole.generate(prompt, SamplingParams(max_tokens=6)))
    assert list(streamed.generate(prompt, SamplingParams(max_tokens=6))) == want
    assert whole.tokenizer.decode(want).startswith("Paris")
    assert not load_cpu_engine(out, stream=False).emulator.stream


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_available_memory_is_the_memory_cgroups_room_where_that_is_less(tmp_path, version):
    """A 16 GiB container on a 24 GiB host: /proc/meminfo shows the host, the memory cgroup its
    limit. Available = limit - usage + reclaimable page cache (inactive file pages), the smaller of
    the two; no limit ("max", or v1's near-2^63) leaves MemAvailable."""
    from g4.serve.engine import available_memory_bytes

    gib = 1 << 30
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: {24 * gib // 1024} kB\nMemAvailable: {20 * gib // 1024} kB\n")
    if version == "v2":
        (tmp_path / "proc/self/cgroup").write_text("0::/box\n")
        base, names = tmp_path / "sys/fs/cgroup/box", ("memory.max", "memory.current", "inactive_file")
    else:
        (tmp_path / "proc/self/cgroup").write_text("5:cpu,cpuacct:/\n4:memory:/box\n0::/\n")
        base = tmp_path / "sys/fs/cgroup/memory/box"
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    base.mkdir(parents=True)
    (base / names[0]).write_text(f"{16 * gib}\n")
    (base / names[1]).write_text(f"{10 * gib}\n")
    (base / "memory.stat").write_text(f"anon 1\n{names[2]} {3 * gib}\n")
    assert available_memory_bytes(tmp_path) == 9 * gib  # 16 - 10 + 3, not the host's 20
    (base / names[1]).write_text(f"{1 * gib}\n")
    assert available_memory_bytes(tmp_path) == 18 * gib
    (base / names[0]).write_text(f"{32 * gib}\n")  # room above MemAvailable: the host's figure
    assert available_memory_bytes(tmp_path) == 20 * gib
    (base / names[0]).write_text("max\n" if version == "v2" else "9223372036854771712\n")
    (base / names[1]).write_text(f"{10 * gib}\n")
    assert available_memory_bytes(tmp_path) == 20 * gib
    (tmp_path / "proc/meminfo").write_text("MemTotal: 1 kB\n")
    assert available_memory_bytes(tmp_path) is None


def test_the_whole_model_load_shows_a_bar_over_the_stored_bytes(capfd):
    """Fresh-user finding: g4serve printed nothing during a 170 s load. The NVFP4 load counts
    every stored byte it reads and dequantizes (KV cache scales included, unread); -q (progress
    False) draws nothing."""
    from serve_fixtures import embedded_result

    from g4.core.checkpoint import Checkpoint
    from g4.convert.reference import load_nvfp4_as_hf
    from g4.exporters.formats import detect_format
    from g4.serve.engine import build_hf_model

    out = embedded_result("nvfp4")
    total = sum(info.nbytes for info in Checkpoint(out).tensors.values())
    counted = []
    sd, scales = load_nvfp4_as_hf(out, on_read=counted.append)
    assert sum(counted) == total and len(counted) == len(Checkpoint(out).tensors)
    capfd.readouterr()
    build_hf_model(out, detect_format(out), torch.bfloat16, act_quant=False, progress=True)
    err = capfd.readouterr().err
    assert f"loading {out.name}:" in err and "100%" in err
    build_hf_model(out, detect_format(out), torch.bfloat16, act_quant=False)
    assert capfd.readouterr().err == ""
    build_hf_model(EMBEDDED_DIR, detect_format(EMBEDDED_DIR), torch.bfloat16, act_quant=False, progress=True)
    assert "Loading weights" in capfd.readouterr().err  # transformers' own bar for a bf16 checkpoint
