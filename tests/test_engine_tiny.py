"""The whole engine on tiny random checkpoints of each family, against HF ``transformers`` greedy decoding.

Covers the HF-directory and GGUF loaders end to end (Llama with MQA-style GQA, Qwen2 with q/k/v bias,
Llama-3 rope scaling with untied embeddings, Mistral), chunked prefill (C02) and preemption (C03) in seconds.
"""

import pytest
import torch
import transformers

from goodserve import LLM, SamplingParams
from tiny_models import EQUALITY_PROMPTS, hf_greedy, make_tiny_gguf, make_tiny_hf_model, tiny_hf_config

PROMPTS = EQUALITY_PROMPTS
NEW = 12


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3", "mistral"])
def test_tiny_hf_dir_matches_hf(tmp_path, arch):
    model_dir = make_tiny_hf_model(tmp_path, arch)
    refs = hf_greedy(model_dir, PROMPTS, NEW)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for budget, num_blocks in ((512, 64), (7, 64), (16, 16)):
        llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=num_blocks,
                  max_num_batched_tokens=budget, log_stats_interval=0)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == refs, (arch, budget, num_blocks)
        kv = llm.engine.core.scheduler.kv_cache_manager
        kv.check_integrity()
        assert kv.usage == 0
        if num_blocks == 16:  # 4 requests of up to 60 tokens in 64 slots: C03, preemption happened
            assert llm.engine.core.scheduler.num_preemptions_total > 0


def test_tiny_gguf_matches_its_weights(tmp_path):
    """A GGUF (llama, Q/K rows permuted as llama.cpp writes them) gives the same tokens as HF on its weights."""
    path, state = make_tiny_gguf(tmp_path, "llama", tie=True)
    hf_dir = tmp_path / "hf"
    hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama", True), dtype=torch.float32)
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    hf.save_pretrained(hf_dir)
    refs = hf_greedy(str(hf_dir), PROMPTS[:2], NEW)
    llm = LLM(path, dtype="float32", num_blocks=64, log_stats_interval=0)
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == refs

