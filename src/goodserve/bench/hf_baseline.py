"""The baseline a user would pick instead of an engine: HF ``transformers`` ``generate`` in static batches.

The HF model is built from the same dequantised weights the engine serves (dense, in the engine's dtype),
so the comparison is between serving systems, not between weight formats. A static batch is left-padded
and runs until its longest request is done — the request-level batching that Orca (Yu et al., OSDI 2022,
§2.2) replaces; only the tokens each request asked for count as output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from goodserve.models.loader import load_model
from goodserve.workload.datasets import RequestSpec


@dataclass
class HFResult:
    """Throughput of one static-batch run.

    Attributes:
        batch_size: Requests per static batch.
        num_requests: Requests run.
        elapsed: Wall seconds.
        output_tokens: Tokens the requests asked for (padding steps excluded).
        prompt_tokens: Prompt tokens of the requests.
    """

    batch_size: int
    num_requests: int
    elapsed: float
    output_tokens: int
    prompt_tokens: int

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def total_throughput(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.elapsed


def build_hf_model(model_path: str, dtype: torch.dtype):
    """A dense ``transformers`` causal LM holding the weights goodserve loads from ``model_path``."""
    import transformers

    loaded = load_model(model_path, dtype)
    c = loaded.config
    # Phi-3's weights arrive split into Llama's names (the same math), so LlamaConfig builds its twin too.
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}.get(c.architecture,
                                                                                   transformers.LlamaConfig)
    hf_config = cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                    max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                    rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                    tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
                    eos_token_id=list(c.eos_token_ids), pad_token_id=(c.eos_token_ids or (0,))[0])
    model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF baseline weights mismatch: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.inference_mode()
def run_static_batches(model, specs: list[RequestSpec], batch_size: int, pad_id: int = 0) -> HFResult:
    """Run ``specs`` in arrival order, ``batch_size`` at a time, each batch to its longest output.

    Args:
        model: A ``transformers`` causal LM.
        specs: Requests with synthesised prompts.
        batch_size: Requests per static batch.
        pad_id: Token used for left padding (masked out).
    """
    start = time.perf_counter()
    for i in range(0, len(specs), batch_size):
        batch = specs[i:i + batch_size]
        width = max(s.prompt_len for s in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, width - s.prompt_len:] = torch.tensor(s.prompt_token_ids)
            mask[row, width - s.prompt_len:] = 1
        n = max(s.output_len for s in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return HFResult(batch_size, len(specs), elapsed, sum(s.output_len for s in specs),
                    sum(s.prompt_len for s in specs))
