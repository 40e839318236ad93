"""Fast tests of the capacity planner: exact KV sizes, pool maths, roofline, errors, plots."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from goodserve.sim.hardware import GIB, HARDWARE, HardwareSpec, get_hardware
from goodserve.sim.plan_cli import add_plan_parser, run_plan
from goodserve.sim.model_size import kv_bytes_per_token, param_count, weights_bytes
from goodserve.sim.planner import make_plan, plan_memory
from goodserve.sim.presets import PRESETS, ArchSpec, load_arch
from goodserve.sim.roofline import decode_bytes, decode_flops, decode_step, max_batch_for_tpot

# A toy dense model with round numbers: 2 layers, H=64, 4 heads, 2 KV heads of 16, MLP 128, vocab 100.
TOY = ArchSpec("toy", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=128, vocab_size=100, max_position_embeddings=1024)
# A toy GPU: 1 MB of memory, 1 GFLOP/s, 1 MB/s, no per-step overhead.
TOY_GPU = HardwareSpec("toy", peak_flops_bf16=1e9, peak_flops_fp8=2e9, mem_bandwidth=1e6, mem_capacity=1_000_000)


def toy_params() -> int:
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v, o
    layer = attn + 3 * 64 * 128 + 2 * 64  # + MLP + two norms
    return 2 * layer + 2 * 100 * 64 + 64  # + embedding, LM head, final norm


@pytest.mark.parametrize(
    ("name", "expected"),
    [("Llama-3-8B", 131_072), ("Llama-3-70B", 327_680), ("Qwen2.5-7B", 57_344), ("Mistral-7B", 131_072),
     ("SmolLM2-135M", 2 * 30 * 3 * 64 * 2), ("DeepSeek-V2", (512 + 64) * 60 * 2)],
)
def test_kv_bytes_per_token_bf16(name, expected):
    assert kv_bytes_per_token(load_arch(name), "bfloat16") == expected


def test_kv_bytes_matches_model_config_and_dtypes():
    arch = load_arch("llama-3-8b")  # case-insensitive
    assert kv_bytes_per_token(arch, "bfloat16") == arch.to_model_config().kv_cache_spec("bfloat16").bytes_per_token()
    assert kv_bytes_per_token(arch, "float8") == 65_536
    assert kv_bytes_per_token(arch, "float32") == 262_144


def test_kv_bytes_under_tp():
    arch = load_arch("Llama-3-70B")  # 8 KV heads
    assert kv_bytes_per_token(arch, "bfloat16", tp=4) == 327_680 // 4
    assert kv_bytes_per_token(arch, "bfloat16", tp=16) == 327_680 // 8  # one replicated head per GPU
    assert kv_bytes_per_token(load_arch("DeepSeek-V2"), "bfloat16", tp=8) == 69_120  # MLA latent is replicated
    with pytest.raises(ValueError, match="KV heads"):
        kv_bytes_per_token(arch, "bfloat16", tp=3)


def test_param_counts():
    assert param_count(load_arch("Llama-3-8B")).total == pytest.approx(8.03e9, rel=0.01)
    assert param_count(load_arch("Llama-3-70B")).total == pytest.approx(70.6e9, rel=0.01)
    assert param_count(load_arch("SmolLM2-135M")).total == pytest.approx(134.5e6, rel=0.01)
    ds = param_count(load_arch("DeepSeek-V2"))
    assert ds.total == pytest.approx(236e9, rel=0.01)
    assert ds.active == pytest.approx(21e9, rel=0.03)
    assert param_count(TOY).total == param_count(TOY).active == toy_params()
    assert weights_bytes(TOY, 2) == 2 * toy_params()


def test_pool_maths_exact():
    w = 2 * toy_params()  # 173,696 bytes
    m = plan_memory(TOY, TOY_GPU, "bfloat16", tp=1, context=100, gpu_memory_utilization=0.5,
                    activation_reserve_bytes=10_000, block_size=16)
    kv_token = 2 * 2 * 2 * 16 * 2  # 256
    pool = 500_000 - w - 10_000
    assert (m.weights, m.kv_bytes_per_token, m.pool_bytes) == (w, kv_token, pool)
    assert m.num_blocks == pool // (kv_token * 16)
    assert m.pool_tokens == m.num_blocks * 16
    assert m.blocks_per_request == 7  # ceil(100 / 16)
    assert m.max_concurrency == m.num_blocks // 7
    assert (pool, m.num_blocks, m.pool_tokens, m.max_concurrency) == (316_304, 77, 1232, 11)


def test_pool_with_tp_halves_weights_and_kv():
    m1 = plan_memory(TOY, TOY_GPU, context=64, activation_reserve_bytes=0)
    m2 = plan_memory(TOY, TOY_GPU, tp=2, context=64, activation_reserve_bytes=0)
    assert m2.weights == m1.weights // 2
    assert m2.kv_bytes_per_token == m1.kv_bytes_per_token // 2


def test_llama3_8b_on_h100_plan():
    m = plan_memory(load_arch("Llama-3-8B"), get_hardware("h100"), context=8192)
    assert m.pool_bytes == int(80e9 * 0.9) - 2 * 8_030_261_248 - GIB
    assert m.kv_bytes_per_request == 8192 * 131_072  # exactly 1 GiB
    assert m.max_concurrency == 51


def test_roofline_memory_bound_at_batch_1_exact():
    p = decode_step(TOY, TOY_GPU, batch=1, context=64, dtype="bfloat16")
    expected_bytes = 2 * toy_params() + 64 * 256
    assert p.bytes == expected_bytes
    assert p.bound == "memory"
    assert p.step_s == expected_bytes / 1e6  # no overhead on the toy GPU
    assert p.tokens_per_s == 1 / p.step_s


def test_roofline_compute_bound_at_large_batch():
    # A GPU with plenty of bandwidth relative to compute turns compute bound quickly.
    gpu = HardwareSpec("c", peak_flops_bf16=1e9, peak_flops_fp8=1e9, mem_bandwidth=1e9, mem_capacity=10**9)
    p = decode_step(TOY, gpu, batch=4096, context=16)
    assert p.bound == "compute"
    assert p.step_s == decode_flops(TOY, 4096, 16) / 1e9
    assert decode_step(TOY, gpu, batch=1, context=16).bound == "memory"
    # Llama-3-8B on H100 at short context: memory bound at 1, compute bound at 2048.
    arch, h100 = load_arch("Llama-3-8B"), get_hardware("h100")
    assert decode_step(arch, h100, 1, 128).bound == "memory"
    assert decode_step(arch, h100, 2048, 128).bound == "compute"


def test_moe_reads_only_touched_experts():
    ds = load_arch("DeepSeek-V2")
    b1 = decode_bytes(ds, 1, 1, "bfloat16")
    assert b1 < weights_bytes(ds, 2) / 5  # ~21B active of 236B
    assert decode_bytes(ds, 4096, 1, "bfloat16") == pytest.approx(weights_bytes(ds, 2) + 4096 * 69_120, rel=1e-3)


def test_max_batch_for_tpot():
    ctx = 64
    budget = decode_step(TOY, TOY_GPU, 10, ctx).step_s
    assert max_batch_for_tpot(TOY, TOY_GPU, ctx, budget, max_batch=1000) == 10
    assert max_batch_for_tpot(TOY, TOY_GPU, ctx, budget, max_batch=7) == 7
    assert max_batch_for_tpot(TOY, TOY_GPU, ctx, budget * 0.999, max_batch=1000) == 9
    assert max_batch_for_tpot(TOY, TOY_GPU, ctx, 1e-9, max_batch=1000) == 0
    with pytest.raises(ValueError):
        max_batch_for_tpot(TOY, TOY_GPU, ctx, 0, max_batch=10)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="Llama-3-8B.*SmolLM2-135M"):
        load_arch("gpt-17")
    with pytest.raises(ValueError, match="h100"):
        get_hardware("tpu")


def test_weights_too_large_suggests_tp():
    with pytest.raises(ValueError, match=r"weights need .* try --tp 2"):
        plan_memory(load_arch("Llama-3-70B"), get_hardware("h100"), context=4096)
    plan_memory(load_arch("Llama-3-70B"), get_hardware("h100"), tp=2, context=4096)  # fits


@pytest.mark.parametrize("kwargs", [dict(context=0), dict(gpu_memory_utilization=1.5), dict(dtype="int3")])
def test_bad_inputs(kwargs):
    with pytest.raises(ValueError):
        plan_memory(TOY, TOY_GPU, **kwargs)


def test_load_from_hf_config(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
           "num_hidden_layers": 28, "intermediate_size": 18944, "vocab_size": 152064,
           "tie_word_embeddings": False, "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for source in (tmp_path, tmp_path / "config.json"):
        arch = load_arch(str(source))
        assert arch.attention_bias and arch.head_dim == 128
        assert param_count(arch).total == param_count(PRESETS["qwen2.5-7b"]).total
        assert kv_bytes_per_token(arch, "bfloat16") == 57_344


def test_presets_parse_config_json_with_the_loaders_parser():
    """One HF config.json parser (ModelConfig.from_hf_config): the planner gets the loader's defaults."""
    from goodserve.config import ModelConfig
    from goodserve.sim.presets import arch_from_hf_config

    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    arch, model = arch_from_hf_config(cfg, "toy"), ModelConfig.from_hf_config(cfg)
    assert (arch.head_dim, arch.num_key_value_heads, arch.max_position_embeddings) == (16, 4, 2048)
    assert arch.attention_bias and model.architecture == "qwen2"  # model_type from the class name
    assert arch.to_model_config().kv_cache_spec("bfloat16") == model.kv_cache_spec("bfloat16")
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match="toy: config.json lacks 'intermediate_size'"):
        arch_from_hf_config(cfg, "toy")


def test_all_hardware_valid():
    for hw in HARDWARE.values():
        assert hw.peak_flops("float8") >= hw.peak_flops("bfloat16") > hw.peak_flops("float32")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers())
    return parser.parse_args(["plan", *argv])


def test_cli_report(capsys):
    assert run_plan(_parse("--model", "Llama-3-8B", "--context", "8192")) == 0
    out = capsys.readouterr().out
    assert "131,072" in out and "max concurrency" in out and "51 requests" in out
    assert "largest batch within TPOT" in out


def test_cli_dtype_takes_the_engines_spelling_and_the_short_aliases():
    assert _parse("--model", "Llama-3-8B").dtype == "bfloat16"
    assert [_parse("--model", "Llama-3-8B", "--dtype", d).dtype for d in ("bf16", "fp8", "fp32", "float8")] == \
        ["bfloat16", "float8", "float32", "float8"]
    with pytest.raises(SystemExit):
        _parse("--model", "Llama-3-8B", "--dtype", "int3")


def test_cli_error_exit_code(capsys):
    assert run_plan(_parse("--model", "Llama-3-70B")) == 2
    assert "--tp 2" in capsys.readouterr().err


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    assert run_plan(_parse("--model", "SmolLM2-135M", "--hardware", "cpu-local", "--context", "2048",
                           "--plot-dir", str(tmp_path / "plots"))) == 0
    files = sorted((tmp_path / "plots").glob("*.png"))
    assert [f.name for f in files] == ["plan_decode.png", "plan_kv_per_request.png", "plan_memory.png"]
    assert all(f.stat().st_size > 1000 for f in files)


def test_make_plan_roofline_rows():
    r = make_plan(TOY, TOY_GPU, context=64, activation_reserve_bytes=0)
    assert [p.batch for p in r.roofline][-1] == r.memory.max_concurrency
    assert all(math.isfinite(p.step_s) for p in r.roofline)


def test_moe_configs_priced_by_active_and_total_parameters():
    """Qwen3-MoE's expert width is moe_intermediate_size, not intermediate_size (Qwen3-30B-A3B: 30.5B total,
    3.3B active, as published); its dense mlp_only_layers leave the MoE layer count; Mixtral 8x7B: 46.7B /
    12.9B."""
    from goodserve.sim.model_size import param_count
    from goodserve.sim.presets import arch_from_hf_config

    qwen = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
            "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}
    p = param_count(arch_from_hf_config(qwen))
    assert (p.total, p.active, p.num_moe_layers) == (30_532_110_336, 3_353_020_416, 48)
    dense2 = param_count(arch_from_hf_config({**qwen, "mlp_only_layers": [0, 47]}))
    assert dense2.num_moe_layers == 46
    assert dense2.total - p.total == 2 * (3 * 2048 * 6144 - 128 * 3 * 2048 * 768 - 2048 * 128)
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
               "num_experts_per_tok": 2, "vocab_size": 32000, "tie_word_embeddings": False}
    p = param_count(arch_from_hf_config(mixtral))
    assert (p.total, p.active) == (46_702_792_704, 12_879_925_248)
