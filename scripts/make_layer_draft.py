"""A draft model for benchmarks: the first N decoder layers of a model, with its embeddings, final norm, LM
head and tokenizer (self-speculation by early exit, as LayerSkip's draft is, without its training).

No smaller model shares SmolLM2-135M's tokenizer offline, so ``scripts/bench_speculation.sh`` measures
draft-model speculation with one of these (``SPEC``; BENCHMARKS.md, "Speculative decoding with a draft
model"). The weights are dequantized by ``transformers`` (``gguf`` installed) and saved as float32
safetensors: an HF directory goodserve loads as ``{"method": "draft_model", "model": OUT}``.

Usage: python scripts/make_layer_draft.py OUT [--layers 6] [--model GGUF]   (default: the default model)
"""

from __future__ import annotations

import argparse
import os

from transformers import AutoModelForCausalLM, AutoTokenizer

from goodserve.models.loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the HF directory to write")
    ap.add_argument("--layers", type=int, default=6, help="decoder layers kept, from the first")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    args = ap.parse_args()
    path = args.model or default_model_path()
    folder, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    if not 1 <= args.layers <= model.config.num_hidden_layers:
        raise SystemExit(f"--layers must be in [1, {model.config.num_hidden_layers}], got {args.layers}")
    model.hf_quantizer, model.is_quantized = None, False  # dequantized on load: saved as plain weights
    model.config.__dict__.pop("quantization_config", None)
    model.model.layers = model.model.layers[:args.layers]
    model.config.num_hidden_layers = args.layers
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(args.out)
    print(f"wrote {args.out}: the first {args.layers} of the layers of {path}")


if __name__ == "__main__":
    main()
