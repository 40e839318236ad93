"""The planner prices the KV cache by the engine's formula: dtypes (int8 rows with their scale), sliding
windows in whole blocks, MLA latents. Every expected figure is worked out by hand below."""

from __future__ import annotations

import argparse

import pytest

from goodserve.sim.hardware import GIB, get_hardware
from goodserve.sim.model_size import kv_bytes_per_token, kv_cache_spec, param_count
from goodserve.sim.plan_cli import add_plan_parser, run_plan
from goodserve.sim.planner import plan_memory
from goodserve.sim.presets import arch_from_hf_config, load_arch
from goodserve.sim.roofline import decode_bytes, decode_flops

H100_USABLE = int(80e9 * 0.9)  # 80 GB x 0.9 utilisation
LLAMA3_8B_PARAMS = 8_030_261_248
GEMMA3_27B_PARAMS = 27_008_663_808
DEEPSEEK_V3_PARAMS = 671_026_404_352


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def test_llama3_8b_bytes_per_token_and_concurrency_bf16_and_int8():
    arch = load_arch("Llama-3-8B")
    bf16 = 2 * 32 * 8 * 128 * 2  # K and V x 32 layers x 8 KV heads x 128 elements x 2 bytes
    int8 = 2 * 32 * 8 * (128 + 4)  # an int8 row is 128 bytes plus its 4-byte float32 scale
    assert (bf16, int8) == (131_072, 67_584)
    assert kv_bytes_per_token(arch, "bfloat16") == bf16
    assert kv_bytes_per_token(arch, "int8") == int8
    pool = H100_USABLE - 2 * LLAMA3_8B_PARAMS - GIB  # 54,865,735,680 bytes
    for kv_dtype, per_token, expected in (("bfloat16", bf16, 51), ("int8", int8, 99)):
        m = plan_memory(arch, get_hardware("h100"), context=8192, kv_cache_dtype=kv_dtype)
        assert (m.pool_bytes, m.kv_bytes_per_token) == (pool, per_token)
        assert m.kv_bytes_per_request == 8192 * per_token
        assert m.max_concurrency == pool // (8192 * per_token) == expected
        assert m.num_blocks == pool // (16 * per_token)
        assert m.max_concurrency == m.num_blocks // m.blocks_per_request  # no windows: the same count
    # the default KV dtype is the weights dtype
    assert plan_memory(arch, get_hardware("h100"), context=8192).kv_spec.kv_dtype == "bfloat16"


def test_gemma3_27b_windows_cut_the_local_layers_to_1024_tokens():
    arch = load_arch("Gemma-3-27B")
    assert (arch.num_hidden_layers, arch.num_sliding_layers, arch.sliding_window) == (62, 52, 1024)
    assert param_count(arch).total == GEMMA3_27B_PARAMS
    full_token = 2 * 10 * 16 * 128 * 2  # 10 global layers x 16 KV heads x 128 x bf16 = 81,920
    local_token = 2 * 52 * 16 * 128 * 2  # 52 local layers = 425,984
    assert kv_bytes_per_token(arch, "bfloat16") == full_token + local_token == 507_904
    spec = kv_cache_spec(arch, "bfloat16")
    assert spec.describe() == "bfloat16: full x10 (16 x 128), sliding x52 (16 x 128, window 1024)"
    pool = H100_USABLE - 2 * GEMMA3_27B_PARAMS - GIB
    # context a multiple of 16: the global layers keep every token, the local ones the 1024 / 16 = 64 blocks
    # overlapping the window [context - 1024, context)
    for context, per_request, concurrency in ((8192, 1_107_296_256, 15), (32768, 3_120_562_176, 5),
                                              (131072, 11_173_625_856, 1)):
        assert per_request == context * full_token + 1024 * local_token
        assert concurrency == pool // per_request
        m = plan_memory(arch, get_hardware("h100"), context=context)
        assert (m.kv_bytes_per_request, m.max_concurrency) == (per_request, concurrency)
        assert m.kv_bytes_per_token == 507_904 and m.blocks_per_request == context // 16
    # not block-aligned: 8001 tokens need 501 blocks of the global layers; the window [6977, 8001) touches
    # blocks 6977 // 16 = 436 .. 8000 // 16 = 500, 65 blocks
    m = plan_memory(arch, get_hardware("h100"), context=8001)
    assert m.kv_bytes_per_request == 501 * 16 * full_token + 65 * 16 * local_token
    # int8: every row is 128 + 4 bytes
    m = plan_memory(arch, get_hardware("h100"), context=32768, kv_cache_dtype="int8")
    assert m.kv_bytes_per_token == 2 * 62 * 16 * 132 == 261_888
    assert m.kv_bytes_per_request == 32768 * 2 * 10 * 16 * 132 + 1024 * 2 * 52 * 16 * 132 == 1_609_039_872
    assert m.max_concurrency == pool // 1_609_039_872 == 10


def test_deepseek_v3_mla_latent_per_token():
    arch = load_arch("DeepSeek-V3")
    assert kv_bytes_per_token(arch, "bfloat16") == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(arch, "int8") == 61 * (576 + 4) == 35_380
    assert kv_bytes_per_token(arch, "bfloat16", tp=16) == 70_272  # the latent is replicated, not split
    p = param_count(arch)
    assert p.total == DEEPSEEK_V3_PARAMS  # 671B published (the MTP module is not counted)
    assert p.active == pytest.approx(37e9, rel=0.02)
    # float8 weights over 16 GPUs
    pool = H100_USABLE - -(-DEEPSEEK_V3_PARAMS // 16) - GIB
    for kv_dtype, per_token in (("bfloat16", 70_272), ("int8", 35_380)):
        m = plan_memory(arch, get_hardware("h100"), "float8", tp=16, context=32768, kv_cache_dtype=kv_dtype)
        assert m.pool_bytes == pool
        assert m.max_concurrency == pool // (32768 * per_token)


def test_the_roofline_reads_at_most_the_window_of_a_sliding_layer():
    arch = load_arch("Gemma-3-27B")
    weights = decode_bytes(arch, 1, 0, "bfloat16")
    assert decode_bytes(arch, 1, 512, "bfloat16") - weights == 512 * 507_904  # inside the window: all layers
    assert decode_bytes(arch, 1, 32768, "bfloat16") - weights == 32768 * 81_920 + 1024 * 425_984
    assert decode_bytes(arch, 1, 32768, "bfloat16", kv_dtype="int8") - weights == \
        32768 * 2 * 10 * 16 * 132 + 1024 * 2 * 52 * 16 * 132
    # attention FLOPs: 10 layers attend to the whole context, 52 to 1024 tokens
    per_pair = 2 * 32 * (128 + 128)
    assert decode_flops(arch, 1, 32768) - decode_flops(arch, 1, 0) == per_pair * (10 * 32768 + 52 * 1024)


def _gemma3_config() -> dict:
    # the shape of google/gemma-3-27b-it's config.json: the decoder is under text_config and leaves the
    # vocabulary, tied embeddings and the local:global pattern to Gemma3TextConfig's defaults
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
                            "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                            "head_dim": 128, "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152}}


def test_hf_configs_give_windows_and_sliding_layers():
    gemma = arch_from_hf_config(_gemma3_config(), "gemma")
    preset = load_arch("Gemma-3-27B")
    assert gemma == type(preset)(**{**preset.__dict__, "name": "gemma"})
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]
    cfg = _gemma3_config()
    cfg["text_config"] = {**cfg["text_config"], "layer_types": layer_types[:-2] + ["full_attention"] * 2}
    assert arch_from_hf_config(cfg).num_sliding_layers == 50  # layer_types decide: layers 60, 61 made global
    gemma2 = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
              "sliding_window": 4096}
    assert (arch_from_hf_config(gemma2).num_sliding_layers, arch_from_hf_config(gemma2).sliding_window) == (21, 4096)
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096}
    a = arch_from_hf_config(mistral)
    assert (a.num_sliding_layers, a.sliding_window) == (32, 4096)
    assert [g.kind for g in kv_cache_spec(a, "bfloat16").groups] == ["sliding"]
    assert a.to_model_config().sliding_window == 4096
    qwen2 = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "sliding_window": 4096,
             "max_window_layers": 20}
    assert arch_from_hf_config(qwen2).sliding_window is None  # use_sliding_window absent: full attention
    assert arch_from_hf_config({**qwen2, "use_sliding_window": True}).num_sliding_layers == 8  # layers 20..27
    llama = {**mistral, "model_type": "llama"}
    assert arch_from_hf_config(llama).sliding_window is None  # Llama never applies the key
    with pytest.raises(ValueError, match="mixed sliding and full"):
        gemma.to_model_config()


def test_cli_kv_cache_dtype_int8_prints_the_numbers(capsys):
    assert _parse("--model", "Llama-3-8B").kv_cache_dtype is None  # means --dtype
    assert run_plan(_parse("--model", "Llama-3-8B", "--context", "8192", "--kv-cache-dtype", "int8")) == 0
    out = capsys.readouterr().out
    assert "67,584 per GPU  [int8: full x32 (8 x 128)]" in out
    assert "KV cache int8" in out
    assert f"{8192 * 67_584:,} B" in out and "99 requests of 8,192 tokens" in out
    assert run_plan(_parse("--model", "Gemma-3-27B", "--context", "32768")) == 0
    out = capsys.readouterr().out
    assert "507,904 per GPU  [bfloat16: full x10 (16 x 128), sliding x52 (16 x 128, window 1024)]" in out
    assert "3,120,562,176 B" in out and "windows applied" in out and "5 requests of 32,768 tokens" in out


def test_a_bad_kv_cache_dtype_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        _parse("--model", "Llama-3-8B", "--kv-cache-dtype", "int4")
    err = capsys.readouterr().err
    assert "int4" in err and all(d in err for d in ("bfloat16", "float16", "float8", "int8", "float32"))
    with pytest.raises(ValueError, match="int4.*bfloat16.*int8"):
        plan_memory(load_arch("Llama-3-8B"), get_hardware("h100"), kv_cache_dtype="int4")


def test_simulate_sizes_its_pool_and_cost_model_by_the_kv_cache_dtype():
    from goodserve.cli import build_parser
    from goodserve.sim.simulate_cli import build_cluster, build_cost_model

    def parse(*extra: str) -> argparse.Namespace:
        return build_parser().parse_args(["simulate", "--model", "Llama-3-8B", "--max-model-len", "8192", *extra])

    arch = load_arch("Llama-3-8B")
    pool = H100_USABLE - 2 * LLAMA3_8B_PARAMS - GIB
    assert build_cluster(parse(), arch, "chunked").cache.num_blocks == pool // (16 * 131_072)
    assert build_cluster(parse("--kv-cache-dtype", "int8"), arch, "chunked").cache.num_blocks == pool // (16 * 67_584)
    assert build_cost_model(parse("--kv-cache-dtype", "int8"), arch)._kv_bytes_per_token == 67_584
    with pytest.raises(SystemExit):
        parse("--kv-cache-dtype", "int4")


def test_simulate_lays_a_mixed_model_out_in_groups_as_the_engine():
    """Gemma-3-27B in the simulator: the engine's layout (groups of 6 layers: 2 full, 9 local, 4 slots padded),
    pages of 16 tokens x 6 layers, and a hybrid pool on which a 32k-token conversation holds every global block
    but only the local window's; the same scheduler finishes a small workload on it with no leaked block."""
    from goodserve.cli import build_parser
    from goodserve.sim.cost_model import RooflineCostModel
    from goodserve.sim.simulate_cli import build_cluster
    from goodserve.sim.simulator import Simulator
    from goodserve.sim.spec import SimRequest

    arch = load_arch("Gemma-3-27B")
    args = build_parser().parse_args(["simulate", "--model", "Gemma-3-27B", "--max-model-len", "32768"])
    cluster = build_cluster(args, arch, "chunked")
    layout = cluster.cache.layout
    assert (layout.num_slots, layout.group_windows) == (6, (None,) * 2 + (1024,) * 9)
    pool = H100_USABLE - 2 * GEMMA3_27B_PARAMS - GIB
    page = 16 * 6 * 2 * 16 * 128 * 2
    assert cluster.cache.num_blocks == pool // page
    assert cluster.scheduler.max_model_len == 32768  # the windows fit
    sim = Simulator(cluster, RooflineCostModel(arch, get_hardware("h100"), "bfloat16", 1),
                    [SimRequest(f"r{i}", 0.1 * i, 4000 + 500 * i, 64) for i in range(6)])
    result = sim.run()
    assert [(r.success, r.output_tokens) for r in result.records] == [(True, 64)] * 6
    kv = sim.instances[0].scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.num_groups == 11
