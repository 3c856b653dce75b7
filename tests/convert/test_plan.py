"""g4convert plan: per-rank memory from the config alone.

Expected figures are written out as shape arithmetic here (not imported from the code under
test) and checked against shared/specs/gemma4-architecture.md §4 and
shared/specs/nxd-int8-neuron.md §6. GB = 10**9 bytes, GiB = 2**30 bytes.
"""

import json

import pytest
from click.testing import CliRunner

from g4.core.checkpoint import Checkpoint
from g4.convert.embedded_model import EMBEDDED_DIR
from g4.core.errors import G4Error
from g4.convert.cli import plan
from g4.convert import plan as plan_module
from g4.convert.plan import HOST_LOAD_ANON_BYTES, HOST_PAGE_CACHE_KEPT, HOST_RESERVE_BYTES, plan_memory
from g4.convert.synth import GEMMA4_26B_A4B

GB, GiB = 10**9, 2**30
# 26B-A4B geometry (architecture spec §0): 30 layers = 25 sliding + 5 full, H 2816, 16 heads,
# sliding 8 KV x 256, full 2 KV x 512 without v_proj, dense I 2112, 128 experts of I 704, V 262144.
L, LS, LF, H, NH, E, I, IM, V = 30, 25, 5, 2816, 16, 128, 704, 2112, 262144
ROUTERS_NORMS = 21_626_880 + 176_640 + 1_224_252  # spec §4.1: router.proj, router scales, norms+layer_scalar
RANK_INDICES = (L + 1) * 4  # NxD's int32 rank index per layer (ExpertMLPsV2) and for the model
DEVICE_EMBED = V * (H // 2) * 2  # bf16 [V, H/2]: the column shard g4's NxDI class looks tokens up in


def run(*args):
    return CliRunner().invoke(plan, list(args))


def int8_neuron_tp2(**kw):
    return plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.xlarge", **kw)


def test_26b_int8_neuron_tp2_per_group():
    p = int8_neuron_tp2()
    # experts: int8 with expert-wise fp32 scales; gate_up [E, 2I/2, H] + scale [E,1,2I/2] split,
    # down [E, H, I/2] + scale [E,1,H] replicated (nxd spec §1.2, §4.3)
    experts = L * (E * I * H + E * I * 4 + E * H * (I // 2) + E * H * 4)
    lm_head = (V // 2) * H + (V // 2) * 4  # vocab rows split, scale split with them
    dense = L * (2 * (IM // 2) * H + 2 * (IM // 2) * 4 + H * (IM // 2) + H * 4)
    attention_params = LS * (H * 4096 + 2 * H * 2048 + 4096 * H) + LF * (H * 8192 + H * 1024 + 8192 * H)
    assert attention_params == 1_110_179_840  # spec §4.1
    assert p.groups() == {"experts": experts, "lm_head": lm_head, "dense_mlp": dense,
                          "attention": attention_params * 2 // 2, "norms_and_routers": ROUTERS_NORMS + RANK_INDICES,
                          "embedding": DEVICE_EMBED, "vision": 0}
    assert p.experts == 11_473_059_840 and p.lm_head == 369_623_040 and p.dense_mlp == 268_224_000
    assert p.weights_per_rank == 13_982_312_120
    # spec: 13.22 GB without the device embedding; it divides the replicated expert down scales
    # (43 MB) by 2 as well
    assert (p.weights_per_rank - DEVICE_EMBED) / GB == pytest.approx(13.22, abs=0.03)
    assert p.weights_per_rank - DEVICE_EMBED - int(13.222e9) == pytest.approx(L * E * H * 4 // 2, abs=1e6)


def test_26b_int8_neuron_variants():
    base = int8_neuron_tp2().weights_per_rank
    replicated = int8_neuron_tp2(lm_head="bf16-replicated")
    assert replicated.lm_head == V * H * 2
    assert replicated.weights_per_rank - base == 1_106_771_968  # "about 1.1 GB more per rank"
    int8_attn = int8_neuron_tp2(attention="int8")
    assert int8_attn.weights_per_rank == 13_428_061_880
    assert (int8_attn.weights_per_rank - DEVICE_EMBED) / GB == pytest.approx(12.67, abs=0.03)
    assert int8_attn.attention / GB == pytest.approx(0.556, abs=0.001)  # spec D2
    device_emb = int8_neuron_tp2(embedding="device")  # the default: the rank files hold the shard
    assert device_emb.embedding == V * H * 2 // 2 and device_emb.host_embedding == 0
    with pytest.raises(G4Error, match="embedding 'host' does not apply to int8-neuron"):
        int8_neuron_tp2(embedding="host")


def test_inf2_xlarge_fits_on_device_and_host():
    p = int8_neuron_tp2()
    assert p.device_mem_per_rank == 16 * GiB and p.fits is True
    assert p.margin == 16 * GiB - p.total_per_rank > 2 * GB  # 2.27 GB with the device embedding shard
    # both ranks' files (2 x 13.98 GB, the device embedding shard in each) are memory-mapped page
    # cache the load keeps none of (bench/bench_inf2_deploy.py); the need is the measured anonymous
    # memory of the load plus the OS/runtime allowance
    assert p.host_rank_files == 2 * p.weights_per_rank == 2 * 13_982_312_120 and p.host_embedding == 0
    assert p.host_page_cache_kept == HOST_PAGE_CACHE_KEPT == 0
    assert p.host_anonymous == HOST_LOAD_ANON_BYTES and p.host_reserve == HOST_RESERVE_BYTES
    assert p.host_ram_need == HOST_LOAD_ANON_BYTES + HOST_RESERVE_BYTES < 4 * GiB
    assert p.host_ram == 16 * GiB and p.host_fits is True and p.host_margin == 16 * GiB - p.host_ram_need
    # a GPU plan has no host rows; bf16 on Neuron goes through NxDI's own load, which shards every
    # rank's weights in host memory: counted
    gpu = plan_memory(GEMMA4_26B_A4B, fmt="nvfp4", gpu_mem_bytes=80 * GiB)
    assert (gpu.host_rank_files, gpu.host_anonymous, gpu.host_reserve, gpu.host_ram_need) == (0, 0, 0, 0)
    assert gpu.host_fits is None and "\nhost " not in gpu.summary()
    bf16 = plan_memory(GEMMA4_26B_A4B, fmt="bf16", tp=8, target="inf2.48xlarge")
    assert bf16.host_anonymous == bf16.host_reserve == 0 and bf16.host_ram_need == bf16.host_rank_files == 8 * bf16.weights_per_rank
    assert "sharded in host memory by NxDI's own load" in bf16.summary()
    assert int8_neuron_tp2(seq_len=1024 * 1024).fits is False  # a 1M-token cache does not fit
    big = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.8xlarge")
    assert big.fits and big.host_fits


def test_gpu_defaults_follow_the_embedding():
    host = plan_memory(GEMMA4_26B_A4B, fmt="bf16", tp=2, embedding="host")
    assert host.inputs.lm_head == "bf16-sharded" and host.lm_head == V // 2 * H * 2 and host.embedding == 0
    neuron_bf16 = plan_memory(GEMMA4_26B_A4B, fmt="bf16", tp=2, target="trn1.2xlarge")
    assert neuron_bf16.vision == 0 and neuron_bf16.inputs.lm_head == "bf16-sharded"
    assert neuron_bf16.embedding == V // 2 * H * 2 and neuron_bf16.fits is False  # 25.9 GB per core > 16 GiB


def test_26b_bf16_total_includes_vision():
    p = plan_memory(GEMMA4_26B_A4B, fmt="bf16", tp=1)
    assert p.weights_per_rank == 51_611_872_412  # spec §0: index total_size
    assert round(p.weights_per_rank / GB, 2) == 51.61 and round(p.weights_per_rank / GiB, 2) == 48.07
    assert p.groups() == {"experts": 45_675_970_560, "lm_head": 0, "dense_mlp": 1_070_530_560,
                          "attention": 2_220_359_680, "norms_and_routers": ROUTERS_NORMS,
                          "embedding": 1_476_395_008, "vision": 1_139_100_768 + 6_488_064}
    assert p.fits is None and p.host_fits is None
    # a 48 GiB GPU is too small, an 80 GB one is not
    assert plan_memory(GEMMA4_26B_A4B, fmt="bf16", gpu_mem_bytes=48 * GiB).fits is False
    assert plan_memory(GEMMA4_26B_A4B, fmt="bf16", gpu_mem_bytes=80 * GB).fits is True


def test_26b_nvfp4_matches_spec_scenario_c():
    p = plan_memory(GEMMA4_26B_A4B, fmt="nvfp4", tp=1)
    n_experts = L * E * (2 * I + I) * H
    assert p.experts == n_experts * 9 // 16 + L * E * 3 * 8  # n/2 + n/16 + fp32 scalars per linear
    assert round(p.experts / GB, 3) == 12.846 and round(p.attention / GB, 3) == 0.624
    assert round(p.weights_per_rank / GB, 2) == 16.42  # spec §4.3 scenario C


# bf16 K and V bytes per token of one layer on one rank at TP 1: sliding 8 KV heads x 256,
# full 2 KV heads x 512 (K and V both cached, k_eq_v or not)
KV_S, KV_F = 8 * 256 * 2 * 2, 2 * 512 * 2 * 2


def test_gpu_kv_cache_is_what_vllm_reserves_26b_80gib_128k():
    """P18 through the CLI, from the config alone: the sliding layers cost what vLLM reserves
    (vllm/v1/kv_cache_interface.py SlidingWindowSpec.max_memory_usage_bytes), not the window."""
    r = run("gemma-4-26B-A4B", "--format", "nvfp4", "--gpu-mem", "80GiB", "--seq-len", "131072", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    # vllm serve on a GPU of >= 70 GiB schedules 8192 tokens per step (arg_utils get_batch_defaults)
    assert d["inputs"]["max_num_batched_tokens"] == 8192
    # sliding: min(1024 - 1 + 8192, 131072) = 9215 tokens -> ceil(9215 / 16) = 576 blocks of 16 tokens,
    # + 1 block = 577 blocks = 9232 tokens x 8192 B x 25 layers
    assert d["kv_cache_sliding"] == 577 * 16 * KV_S * LS == 1_890_713_600
    assert d["kv_cache_sliding"] > 9 * (1024 * KV_S * LS)  # 9x what costing the window alone gave
    # full: pages unified to the sliding page (16 x 8192 B), so 32-token blocks of 4096 B per token:
    # 131072 / 32 = 4096 blocks
    assert d["kv_cache_full"] == 4096 * 32 * KV_F * LF == 2_684_354_560
    assert d["kv_cache"] == d["kv_cache_sliding"] + d["kv_cache_full"] == 4_575_068_160
    assert d["fits"] is True


def test_gpu_plan_p18_does_not_fit_where_vllm_would_not_start():
    """26B NVFP4 TP1, 32k context, 17.6 GB GPU: the window-costed cache (0.88 GB) fitted, the
    cache vLLM reserves at its default 2048 batched tokens (1.30 GB) does not (the whole GPU
    given to vLLM here, --gpu-memory-utilization 1, to isolate the KV rule)."""
    p = plan_memory(GEMMA4_26B_A4B, fmt="nvfp4", gpu_mem_bytes=int(17.6 * GB), seq_len=32768,
                    gpu_memory_utilization=1.0)
    assert p.inputs.max_num_batched_tokens == 2048  # vllm serve's default below 70 GiB
    # sliding: min(1023 + 2048, 32768) = 3071 tokens -> ceil(3071 / 16) + 1 = 193 blocks of 16
    assert p.kv_cache_sliding == 193 * 16 * KV_S * LS == 632_422_400
    assert p.kv_cache_full == 32768 // 32 * 32 * KV_F * LF == 671_088_640
    assert p.kv_cache == 1_303_511_040 and p.fits is False
    assert p.margin + p.kv_cache - (1024 * KV_S * LS + 32768 * KV_F * LF) > 0  # the old costing said FITS
    r = run("gemma-4-26B-A4B", "--format", "nvfp4", "--gpu-mem", "17.6GB", "--seq-len", "32768")
    assert r.exit_code == 0 and "device: DOES NOT FIT" in r.output and "vLLM's rule" in r.output


def test_gpu_plan_fits_against_vllms_gpu_memory_utilization():
    """vLLM uses 0.9 of each GPU by default: 26B NVFP4 at 8192 tokens on a 17.6 GB GPU fits the
    whole GPU with 0.38 GB spare, but not the 15.84 GB vLLM allots itself."""
    whole = plan_memory(GEMMA4_26B_A4B, fmt="nvfp4", gpu_mem_bytes=int(17.6 * GB), seq_len=8192,
                        gpu_memory_utilization=1.0)
    default = plan_memory(GEMMA4_26B_A4B, fmt="nvfp4", gpu_mem_bytes=int(17.6 * GB), seq_len=8192)
    assert whole.fits is True and default.fits is False
    assert default.inputs.gpu_memory_utilization == 0.9
    assert default.device_mem_per_rank == int(17.6 * GB * 0.9) == 15_840_000_000
    assert whole.margin - default.margin == int(17.6 * GB) - 15_840_000_000
    r = run("gemma-4-26B-A4B", "--format", "nvfp4", "--gpu-mem", "17.6GB", "--seq-len", "8192")
    assert r.exit_code == 0 and "DOES NOT FIT" in r.output and "vLLM uses 0.9 of it" in r.output
    r = run("gemma-4-26B-A4B", "--format", "nvfp4", "--gpu-mem", "17.6GB", "--gpu-memory-utilization", "1")
    assert r.exit_code == 0 and "device: FITS" in r.output
    for bad in ("0", "1.5"):
        r = run("gemma-4-26B-A4B", "--format", "nvfp4", "--gpu-mem", "17.6GB", "--gpu-memory-utilization", bad)
        assert r.exit_code == 2, r.output
    r = run("gemma-4-26B-A4B", "--target", "inf2.xlarge", "--tp", "2", "--gpu-memory-utilization", "0.8")
    assert r.exit_code == 2 and "is a vLLM (GPU) setting" in r.output


def test_gpu_kv_cache_follows_max_num_batched_tokens_and_seq_len():
    def kv(**kw):
        return plan_memory(GEMMA4_26B_A4B, fmt="bf16", **kw)

    # 512 batched: min(1023 + 512, 32768) = 1535 -> ceil(1535 / 16) + 1 = 97 blocks
    assert kv(seq_len=32768, max_num_batched_tokens=512).kv_cache_sliding == 97 * 16 * KV_S * LS
    # a context shorter than window - 1 + batched caps it: min(3071, 2048) = 2048 -> 128 + 1 blocks
    assert kv(seq_len=2048).kv_cache_sliding == 129 * 16 * KV_S * LS
    # 8K, no GPU given: vLLM's fallback 2048 batched; 193 sliding blocks, 8192 / 32 full blocks
    p = kv(seq_len=8192)
    assert p.kv_cache == 193 * 16 * KV_S * LS + 256 * 32 * KV_F * LF == 800_194_560
    assert kv(seq_len=8192, batch=3).kv_cache == 3 * p.kv_cache
    # TP=4: 2 sliding KV heads per rank (2048 B/token), the 2 full ones replicated (1 x 512 x 4 = 2048 B):
    # equal pages, 16-token blocks everywhere
    tp4 = kv(tp=4, seq_len=8192)
    assert tp4.kv_cache == LS * 193 * 16 * 2048 + LF * 8192 * 2048
    assert any("KV heads replicated" in n for n in tp4.notes)
    r = run("gemma-4-26B-A4B", "--format", "bf16", "--seq-len", "32768", "--max-num-batched-tokens", "512", "--json")
    assert json.loads(r.output)["kv_cache_sliding"] == 97 * 16 * KV_S * LS


def test_neuron_kv_cache_is_the_sequence_on_full_layers_and_a_window_ring_on_sliding_ones():
    """g4's NxDI class (setup_attr_for_model) gives a full layer max_length = seq_len positions and a
    sliding layer a ring of sliding_window - 1 = 1023 (the positions a new token attends besides
    itself), with that layer's own KV heads per rank and head dim (NxDI 0.8 kv_cache_manager.py)."""
    p = int8_neuron_tp2()  # 8192 tokens, TP 2: 4 sliding KV heads and 1 full KV head per rank
    assert p.kv_cache_sliding == LS * 4 * 256 * 2 * 2 * 1023 == 104_755_200
    assert p.kv_cache_full == LF * 1 * 512 * 2 * 2 * 8192 == 83_886_080
    # below the window the ring is the whole sequence
    short = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, seq_len=512)
    assert short.kv_cache_sliding == LS * 4 * 256 * 2 * 2 * 512
    assert p.inputs.max_num_batched_tokens is None
    r = run("gemma-4-26B-A4B", "--target", "inf2.xlarge", "--tp", "2", "--max-num-batched-tokens", "2048")
    assert r.exit_code == 2 and "--max-num-batched-tokens is a vLLM (GPU) setting" in r.output


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_neuron_kv_cache_26b_by_hand(tp):
    """Hand computation from the release config numbers: sliding layers num_key_value_heads 8 x head_dim
    256, full layers num_global_key_value_heads 2 x global_head_dim 512; heads split over the ranks, or
    one per rank (replicated) where fewer than ranks; K and V, bf16, batch 3, 4096 positions on the
    full layers and sliding_window - 1 = 1023 on the sliding ones."""
    tc = GEMMA4_26B_A4B["text_config"]
    kinds = tc["layer_types"]
    sliding_heads = tc["num_key_value_heads"] // tp if tc["num_key_value_heads"] >= tp else 1
    full_heads = tc["num_global_key_value_heads"] // tp if tc["num_global_key_value_heads"] >= tp else 1
    per_position = (kinds.count("sliding_attention") * sliding_heads * tc["head_dim"],
                    kinds.count("full_attention") * full_heads * tc["global_head_dim"])
    p = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=tp, seq_len=4096, batch=3)
    assert tc["sliding_window"] == 1024
    assert (p.kv_cache_sliding, p.kv_cache_full) == (per_position[0] * 2 * 2 * 3 * 1023,
                                                     per_position[1] * 2 * 2 * 3 * 4096)
    assert {1: (8, 2), 2: (4, 1), 4: (2, 1), 8: (1, 1)}[tp] == (sliding_heads, full_heads)
    # NxDI's logits: [batch, 1, vocab] fp32 from the one context-encoding and the one token-generation graph
    assert p.buckets == {"context_encoding": [4096], "token_generation": [4096]}
    assert p.logits_outputs == 2 * 3 * V * 4
    # the context-encoding call's attention: fp32 scores + bf16 probabilities [16 / tp heads, S, S] for the
    # longest prompt (the default 4096 tokens here, = seq_len), one sequence whatever the batch
    assert p.context_encoding_attention == tc["num_attention_heads"] // tp * 4096 * 4096 * (4 + 2)
    assert p.total_per_rank == p.weights_per_rank + p.kv_cache + p.logits_outputs + p.context_encoding_attention


def test_nxdi_buckets_follow_autobucketing():
    """NxDI 0.8 modules/autobucketing.py generate_buckets(128, max_length): powers of two from 128 below
    round(log2(max_length)), then max_length; each bucket graph outputs its own logits."""
    p = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, seq_len=8192, enable_bucketing=True,
                    max_context_length=8192)
    assert p.buckets["context_encoding"] == p.buckets["token_generation"] == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert p.logits_outputs == 14 * V * 4
    # by default prompts stop at 4096 (DEFAULT_MAX_CONTEXT_LENGTH): context encoding up to it, token
    # generation up to seq_len (NxDI's generate_buckets_for_cte / _for_tkg)
    p = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, seq_len=131072, enable_bucketing=True)
    assert p.buckets["context_encoding"] == [128, 256, 512, 1024, 2048, 4096]
    assert p.buckets["token_generation"] == [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    assert p.logits_outputs == 17 * V * 4 and p.inputs.max_context_length == 4096
    def tkg(n):
        return plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, seq_len=n, enable_bucketing=True).buckets[
            "token_generation"]
    # log2(3000) = 11.55 rounds to 12: 2048 is a bucket; log2(2500) = 11.29 rounds to 11: it is not
    assert tkg(3000) == [128, 256, 512, 1024, 2048, 3000] and tkg(2500) == [128, 256, 512, 1024, 2500]
    assert tkg(128) == [128] and tkg(100) == [100]
    r = run("gemma-4-26B-A4B", "--tp", "2", "--seq-len", "1024", "--bucketing", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["buckets"]["context_encoding"] == [128, 256, 512, 1024]
    r = run("gemma-4-26B-A4B", "--format", "bf16", "--gpu-mem", "80GB", "--bucketing")
    assert r.exit_code == 2 and "--bucketing is an NxDI (Neuron) setting" in r.output


def test_per_layer_config_form_plans_the_same():
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**{k: v for k, v in GEMMA4_26B_A4B.items() if k != "architectures"}).to_dict()
    assert "per_layer_config" in hf["text_config"] and not hf["text_config"].get("global_head_dim")
    for kw in ({"fmt": "int8-neuron", "tp": 2}, {"fmt": "nvfp4", "tp": 4}):
        assert plan_memory(hf, **kw).to_dict() == plan_memory(GEMMA4_26B_A4B, **kw).to_dict()


def test_embedded_bf16_equals_its_checkpoint():
    config = json.loads((EMBEDDED_DIR / "config.json").read_text())
    p = plan_memory(config, fmt="bf16", tp=1, src_dir=EMBEDDED_DIR)
    on_disk = sum(info.nbytes for info in Checkpoint(EMBEDDED_DIR).tensors.values())
    assert p.weights_per_rank == on_disk == 3_142_344
    # the meta-device build of the vision tower agrees with the checkpoint headers
    assert plan_memory(config, fmt="bf16", tp=1).vision == p.vision > 0
    # bytes of `g4convert nvfp4 embedded` (W4A4) as written, measured once
    assert plan_memory(config, fmt="nvfp4", tp=1, src_dir=EMBEDDED_DIR).weights_per_rank == 1_129_632


@pytest.mark.parametrize("args", [
    ["--target", "inf2.xlarge", "--tp", "2"],
    ["--format", "nvfp4", "--gpu-mem", "24GiB", "--tp", "2"],
    ["--format", "bf16", "--seq-len", "64", "--batch", "4"],
])
def test_cli_embedded_plans(args):
    r = run("embedded", *args)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("memory plan: embedded,")
    fit_checked = "--target" in args or "--gpu-mem" in args
    assert ("device: FITS" in r.output) == fit_checked


def test_cli_text_report_26b():
    r = run("gemma-4-26B-A4B", "--target", "inf2.xlarge", "--tp", "2")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    experts = next(line for line in lines if line.strip().startswith("experts"))
    assert "11,473,059,840" in experts and "11.473" in experts and "10.685" in experts
    assert "device: FITS" in r.output and "host:   FITS" in r.output
    assert "memory-mapped: page cache, read once by initialize, not counted" in r.output
    assert "vision tower and embed_vision not counted" in r.output


def test_cli_json_has_integer_bytes():
    r = run("gemma-4-26B-A4B", "--target", "inf2.xlarge", "--tp", "2", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    for key in ("experts", "lm_head", "dense_mlp", "attention", "norms_and_routers", "embedding", "vision",
                "kv_cache", "weights_per_rank", "total_per_rank", "device_mem_per_rank", "margin", "host_ram_need"):
        assert type(d[key]) is int, key
    assert d["weights_per_rank"] == 13_982_312_120 and d["fits"] is True and d["host_fits"] is True
    assert d["inputs"] == {"model": "gemma-4-26B-A4B", "fmt": "int8-neuron", "tp": 2, "target": "inf2.xlarge",
                           "gpu_mem_bytes": None, "seq_len": 8192, "batch": 1, "lm_head": "int8-sharded",
                           "attention": "bf16", "embedding": "device", "max_num_batched_tokens": None,
                           "enable_bucketing": False, "gpu_memory_utilization": None, "max_context_length": 4096}
    assert type(d["logits_outputs"]) is int and d["buckets"] == {"context_encoding": [4096], "token_generation": [8192]}
    assert type(d["context_encoding_attention"]) is int
    assert (d["longest_seq_len"], d["max_positions"]) == (223183, 262144)
    r = run("gemma-4-26B-A4B", "--format", "bf16", "--gpu-mem", "128GiB", "--json")
    d = json.loads(r.output)
    assert d["inputs"]["gpu_mem_bytes"] == 128 * GiB and d["device_mem_per_rank"] == int(128 * GiB * 0.9) and d["fits"] is True


def test_config_file_and_directory_sources(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps(GEMMA4_26B_A4B))
    r = run(str(tmp_path / "cfg.json"), "--format", "int8-neuron", "--tp", "2", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["weights_per_rank"] == 13_982_312_120
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(GEMMA4_26B_A4B))
    r = run(str(tmp_path / "ckpt"), "--format", "bf16", "--json")  # no weights: vision from the config
    assert r.exit_code == 0 and json.loads(r.output)["weights_per_rank"] == 51_611_872_412


def test_tp3_refused_with_a_clear_message():
    r = run("gemma-4-26B-A4B", "--tp", "3")
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert r.output.startswith("error: --tp 3 cannot be mapped onto this model: "
                               "num_attention_heads 16 is not divisible by 3;")
    assert "TP degrees that work: 1, 2, 4, 8, 16" in r.output
    with pytest.raises(G4Error, match="moe_intermediate_size 704 is not divisible by 3"):
        plan_memory(GEMMA4_26B_A4B, fmt="bf16", tp=3)
    # NVFP4 at TP=8: each rank would hold 88 of the 704 expert inputs, not whole 16-element blocks
    assert plan_memory(GEMMA4_26B_A4B, fmt="bf16", tp=8).weights_per_rank > 0
    nvfp4_tp8 = r"moe_intermediate_size: 88 inputs per rank .* \(TP degrees that work: 1, 2, 4\)$"
    with pytest.raises(G4Error, match=nvfp4_tp8):
        plan_memory(GEMMA4_26B_A4B, fmt="nvfp4", tp=8)


@pytest.mark.parametrize("args, message", [
    (["--target", "inf2.xlarge", "--tp", "4"], "needs 4 NeuronCores; inf2.xlarge has 2"),
    (["--format", "nvfp4", "--target", "inf2.xlarge"], "NVFP4 cannot be served on inf2.xlarge"),
    (["--target", "inf2.xlarge", "--gpu-mem", "80GB"], "not both"),
    (["--format", "bf16", "--lm-head", "int8-sharded"], "int8 lm_head exists only in the int8-neuron format"),
    (["--format", "nvfp4", "--attention", "int8"], "attention int8 does not exist in the nvfp4 format"),
    (["--lm-head", "tied"], "lm_head 'tied' shares the embedding table on a GPU"),
])
def test_impossible_combinations_refused(args, message):
    r = run("gemma-4-26B-A4B", *args)
    assert r.exit_code == 2 and r.output.count("\n") == 1 and message in r.output, r.output


def test_bad_sources_refused(tmp_path):
    r = run(str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and "not a checkpoint directory, a config.json file or a known model" in r.output
    (tmp_path / "bad.json").write_text("{")
    assert "invalid JSON" in run(str(tmp_path / "bad.json")).output
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama"}))
    assert "expected 'gemma4' or 'gemma4_text'" in run(str(tmp_path / "llama.json")).output


def _header_only_checkpoint(path, config):
    """A checkpoint directory whose one safetensors file has the real header of ``config``'s model
    (names, dtypes and shapes from transformers' own model on the meta device, convert/synth.py) and
    a sparse, all-zero data section: the exporter's source reader sees the real 26B inventory, and no
    weight byte is on disk."""
    from g4.convert.synth import synthetic_specs

    header, offset = {}, 0
    for spec in synthetic_specs(config):
        header[spec.name] = {"dtype": "BF16", "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.mkdir()
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("attention", ["bf16", "int8"])
def test_neuron_weights_are_the_bytes_the_exporter_writes(tmp_path, attention):
    """Issue 11: the int8-neuron plan's per-rank weight bytes equal the bytes of the tensors
    ``g4convert int8-neuron`` would write into a rank file (its own spec list from the source's
    headers, convert/int8_neuron.py), for the embedded model and the real 26B-A4B inventory at
    every TP degree they can be split over (embedded: 1, 2, 4; 26B: 1, 2, 4, 8)."""
    from g4.convert.int8_neuron import source_rank_specs

    big = Checkpoint(_header_only_checkpoint(tmp_path / "26b", GEMMA4_26B_A4B), source=True)
    for ckpt, degrees in ((Checkpoint(EMBEDDED_DIR, source=True), (1, 2, 4)), (big, (1, 2, 4, 8))):
        for tp in degrees:
            specs = source_rank_specs(ckpt, tp, quantize_attention=attention == "int8")
            p = plan_memory(ckpt.config, fmt="int8-neuron", tp=tp, attention=attention)
            assert p.weights_per_rank == sum(s.nbytes for s in specs), (ckpt.root, tp)
            experts = sum(s.nbytes for s in specs if ".moe.expert_mlps.mlp_op." in s.name)
            embedding = sum(s.nbytes for s in specs if s.name == "embed_tokens.weight")
            assert p.experts == experts and p.embedding == embedding > 0
    # the embedded model cannot be split over 8 ranks (4 query heads); the plan says so
    with pytest.raises(G4Error, match="cannot be mapped"):
        plan_memory(Checkpoint(EMBEDDED_DIR).config, fmt="int8-neuron", tp=8)


def test_a_g4_result_is_planned_as_the_result_it_is():
    """Fresh-user finding: `plan` refused an NVFP4 result as already quantized although it only
    plans, and planned an int8-neuron result at TP 1 whatever TP its rank files were written for."""
    from serve_fixtures import embedded_result

    nvfp4, int8 = embedded_result("nvfp4"), embedded_result("int8-neuron")  # int8-neuron: TP 2
    r = run(str(nvfp4), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    config = json.loads((nvfp4 / "config.json").read_text())
    source = plan_memory(json.loads((EMBEDDED_DIR / "config.json").read_text()), fmt="nvfp4")
    assert d["inputs"]["fmt"] == "nvfp4" and d["inputs"]["attention"] == "nvfp4" and "NVFP4 W4A4" in d["inputs"]["model"]
    assert d["weights_per_rank"] == source.weights_per_rank == plan_memory(config, fmt="nvfp4").weights_per_rank
    d = json.loads(run(str(int8), "--json").output)
    assert (d["inputs"]["fmt"], d["inputs"]["tp"], d["inputs"]["target"], d["inputs"]["enable_bucketing"]) == (
        "int8-neuron", 2, "inf2.xlarge", True)
    assert d["inputs"]["seq_len"] == json.loads((int8 / "manifest.json").read_text())["max_length"]
    assert json.loads(run(str(int8), "--target", "inf2.8xlarge", "--json").output)["inputs"]["target"] == "inf2.8xlarge"
    for src, args, fix in [(nvfp4, ["--format", "int8-neuron"], "pass --format nvfp4 (or leave --format out)"),
                           (nvfp4, ["--attention", "bf16"], "pass --attention nvfp4"),
                           (int8, ["--tp", "1"], "its rank files are one per TP rank; pass --tp 2")]:
        r = run(str(src), *args)
        assert r.exit_code == 2 and r.output.count("\n") == 1 and fix in r.output, r.output
        assert r.output.startswith(f"error: {src}: an ") and "or plan the source it was converted from" in r.output


def test_a_quantized_checkpoint_that_is_not_a_g4_result_names_the_config_to_plan(tmp_path):
    import shutil

    src = shutil.copytree(EMBEDDED_DIR, tmp_path / "gptq")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "gptq"}}))
    r = run(str(src))
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "quant_method 'gptq'" in r.output and f"pass {src / 'config.json'} to plan the model" in r.output
    assert run(str(src / "config.json")).exit_code == 0


def test_check_exits_1_when_something_does_not_fit(monkeypatch):
    """Fresh-user finding: DOES NOT FIT exited 0. With --check: 1 for the device or the host (the
    host made short by a 15 GiB OS/runtime allowance: no real target is host-short for the 26B)."""
    host_short = ["gemma-4-26B-A4B", "--target", "inf2.xlarge", "--tp", "2"]  # device FITS
    assert run(*host_short, "--check").exit_code == 0
    monkeypatch.setattr(plan_module, "HOST_RESERVE_BYTES", 15 * GiB)
    assert run(*host_short).exit_code == 0
    r = run(*host_short, "--check")
    assert r.exit_code == 1 and "host:   DOES NOT FIT" in r.output
    assert run(*host_short, "--check", "--json").exit_code == 1
    assert run("gemma-4-26B-A4B", "--target", "inf2.8xlarge", "--tp", "2", "--check").exit_code == 0
    r = run("gemma-4-26B-A4B", "--format", "bf16", "--gpu-mem", "24GiB", "--check")
    assert r.exit_code == 1 and "device: DOES NOT FIT" in r.output
    assert run("embedded", "--check").exit_code == 0  # no target: nothing to check


def test_longest_seq_len_on_inf2_xlarge_by_hand():
    """Issue 21's targets: the 26B-A4B at TP 2 on inf2.xlarge with prompts of up to 4096 tokens (the
    default max_context_length) fits 131072 tokens at batch 1 and 8192 x 4; the longest sequence is
    what the spare device memory buys at 10240 bytes per token per sequence (5 full layers x 1 KV head
    per rank x 512 x K and V x bf16) once the 25 sliding layers' rings (1023 positions), the two
    graphs' fp32 logits and the 4096-token context encoding's attention (8 heads per rank x 4096^2 x
    fp32 scores + bf16 probabilities) are paid."""
    attention = 8 * 4096 * 4096 * (4 + 2)
    for batch, longest in ((1, 223183), (4, 47969)):
        p = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.xlarge", batch=batch)
        rings = batch * LS * 4 * 256 * 2 * 2 * 1023
        logits = 2 * batch * V * 4
        spare = 16 * 2**30 - p.weights_per_rank - rings - logits - attention
        assert p.context_encoding_attention == attention
        assert p.longest_seq_len == spare // (batch * LF * 1 * 512 * 2 * 2) == longest
        at = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.xlarge", batch=batch, seq_len=longest)
        past = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.xlarge", batch=batch,
                           seq_len=longest + 1)
        assert at.fits and not past.fits
        assert f"longest --seq-len that fits the device at --batch {batch}: {longest} tokens" in p.summary()
    assert plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.xlarge", seq_len=131072).fits
    assert plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.xlarge", seq_len=8192, batch=4).fits
    # a whole 8192-token prompt in one context encoding: 3.2 GB of attention scores, which do not fit
    long_prompt = plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.xlarge", max_context_length=8192)
    assert long_prompt.context_encoding_attention == 8 * 8192 * 8192 * 6 and not long_prompt.fits
    with pytest.raises(G4Error, match="--max-context-length 9000: a prompt can be 1 to 8192 tokens"):
        plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2, target="inf2.xlarge", max_context_length=9000)
    with pytest.raises(G4Error, match="--max-context-length is an NxDI"):
        plan_memory(GEMMA4_26B_A4B, fmt="nvfp4", gpu_mem_bytes=80 * 10**9, max_context_length=4096)
    assert plan_memory(GEMMA4_26B_A4B, fmt="int8-neuron", tp=2).longest_seq_len is None  # no target


def test_longest_seq_len_bisects_and_caps():
    assert plan_module.longest_seq_len(lambda n: 100 + n, 1000, None) == 900
    assert plan_module.longest_seq_len(lambda n: 100 + n, 1000, 512) == 512
    assert plan_module.longest_seq_len(lambda n: 100 + n, 100, 512) == 0
