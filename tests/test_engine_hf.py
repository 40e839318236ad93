"""The engine on the default model (SmolLM2-135M-Instruct) against HF ``transformers`` greedy decoding.

Eight prompts of different lengths are generated together and must equal HF's greedy tokens exactly
(float32): with the default token budget, with budgets that chunk every prompt (C02), and with a KV pool
so small that requests are preempted and recomputed (C03). In bfloat16 the comparison is
logprobs-close (vLLM's ``check_logprobs_close`` idea): the sequences may only diverge at a position where
each side's token is among the other's top candidates.
"""

import random

import pytest
import torch

from goodserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three fruits that are red, and say why each one is red.",
    "Explain in two sentences why the sky is blue, as if talking to a child who keeps asking why.",
    "Translate 'good morning' into Spanish, French and German.",
    "Summarise the plot of Romeo and Juliet. " * 3,
    "Here is a list of numbers: " + ", ".join(str(i * 7 % 101) for i in range(60)) + ". What is the largest?",
]


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    import os

    import transformers

    d, f = os.path.split(default_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="module")
def llm_fp32():
    return LLM(dtype="float32", num_blocks=512, max_num_batched_tokens=512, log_stats_interval=0)


@pytest.fixture(scope="module")
def prompts(llm_fp32):
    return [llm_fp32.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def _hf_greedy(model, ids, n=NEW_TOKENS, eos=(2,)):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=list(eos),
                             pad_token_id=eos[0])
    toks = out[0, len(ids):].tolist()
    return toks


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts):
    return [_hf_greedy(hf_model, p) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def test_prompt_lengths_cover_chunking(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 37 < lengths[-1] and len(set(lengths)) == len(lengths)


def test_greedy_batch_equals_hf(llm_fp32, prompts, hf_reference):
    outs = llm_fp32.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    llm_fp32.engine.core.scheduler.kv_cache_manager.check_integrity()
    assert llm_fp32.engine.core.scheduler.kv_cache_manager.usage == 0


@pytest.mark.parametrize("budget", [16, 37, 4096])
def test_chunked_prefill_equals_hf(prompts, hf_reference, budget):
    """C02: identical greedy tokens for budgets 16, 37 (odd) and one larger than every prompt."""
    llm = LLM(dtype="float32", num_blocks=512, max_num_batched_tokens=budget, log_stats_interval=0)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference
    llm.engine.core.scheduler.kv_cache_manager.check_integrity()


def test_preemption_equals_hf(prompts, hf_reference):
    """C03: a pool too small for all eight: requests are preempted, resumed, and still equal HF alone."""
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    num_blocks = (longest + 15) // 16 + 4
    llm = LLM(dtype="float32", num_blocks=num_blocks, max_num_batched_tokens=64, log_stats_interval=0,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference
    assert llm.engine.core.scheduler.num_preemptions_total > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.core.scheduler.num_preemptions_total
    kv = llm.engine.core.scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.usage == 0


def test_seeded_sampling_ignores_batch_neighbours(llm_fp32, prompts):
    """C13: each request's tokens depend only on its own seed and prompt."""
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=12) for i in range(8)]
    in_order = llm_fp32.generate(prompts, params, use_tqdm=False)
    order = list(range(8))
    random.Random(3).shuffle(order)
    shuffled = llm_fp32.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    by_index = {i: o.token_ids for i, o in zip(order, shuffled)}
    assert [o.token_ids for o in in_order] == [by_index[i] for i in range(8)]
    alone = llm_fp32.generate([prompts[5]], [params[5]], use_tqdm=False)
    assert alone[0].token_ids == in_order[5].token_ids
    assert len({tuple(o.token_ids) for o in in_order}) == 8


def test_stop_string_inside_a_token(llm_fp32):
    """C05: stop=["Pari"] cuts before "Pari" although it is not a token boundary."""
    prompt = llm_fp32.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    free = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "Paris" in free.text
    out = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=["Pari"]),
                            use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == "Pari"
    assert "Pari" not in out.text
    assert out.text == free.text[: free.text.index("Pari")]


def test_oversize_request_refused_while_small_ones_complete():
    """C04: a prompt needing ~63 blocks against a pool of 50 is refused at once; small ones complete."""
    llm = LLM(dtype="float32", num_blocks=50, log_stats_interval=0)
    big = list(range(1000, 1000 + 63 * 16 - 8))
    with pytest.raises(ValueError, match="maximum context length is 800 tokens"):
        llm.generate([[1, 2, 3], big, [4, 5, 6]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing left half-queued
    outs = llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_bfloat16_logprobs_close_to_hf(default_model_path, prompts, quantization):
    """bfloat16 engine vs HF bfloat16: where greedy tokens first diverge, each is in the other's top 5.

    (transformers keeps GGUF weights packed and computes in float32 even when asked for bfloat16, so the
    two differ in rounding and exact equality is not expected.) ``auto`` runs the file's Q4_1 blocks on the
    int4 kernel for the decode steps (issue 15): the same tolerance holds on the held prompts."""
    import os

    import transformers

    d, f = os.path.split(default_model_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.bfloat16).eval()
    llm = LLM(dtype="bfloat16", quantization=quantization, num_blocks=512, max_num_batched_tokens=64,
              log_stats_interval=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_scores=True, return_dict_in_generate=True, eos_token_id=[2], pad_token_id=2)
        ref = gen.sequences[0, len(prompt):].tolist()
        for pos, (ours, theirs) in enumerate(zip(out.token_ids, ref)):
            if ours == theirs:
                continue
            hf_top = torch.topk(gen.scores[pos][0], 5).indices.tolist()
            our_top = [t for t, _ in out.outputs[0].top_logprobs[pos]]
            assert ours in hf_top and theirs in our_top, (prompt, pos)
            break
