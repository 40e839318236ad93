#!/usr/bin/env bash
# Quantized KV cache (issue 31), one job, every comparison interleaved, under the bench lock:
#   A. accuracy on the default model: greedy agreement and mean |dlogprob| of int8 (and bfloat16) KV against
#      the reference KV dtype, 50 real-text prompts x 128 tokens (scripts/kv_dtype_accuracy.py);
#   B. decode step time at 2k and 4k context, batch 1 and 4, each KV dtype in turn (bench micro; ROUNDS="1 2")
#      With LLAMA_BIN (llama.cpp's bin folder), llama-bench's decode at the same depths, f16 vs q8_0 KV.
#   C. served goodput at the same --kv-cache-memory on a memory-bound load (azure-conv prompts clipped to
#      1024 tokens, a pool that holds about two of them in bfloat16): int8 vs bfloat16, interleaved per rate.
#   D. with LLAMA_BIN: part C's load served by goodserve with int8 KV against llama-server with q8_0 K and V in
#      one unified KV buffer of the same bytes (-c KV_MEM / 12,240 B a token: a q8_0 row of 64 is 68 bytes, as
#      goodserve's int8 row with its scale; -np 16 slots share it, --kv-unified), interleaved per rate.
# Usage: scripts/bench_kv_dtype.sh OUT_DIR   (PART=A|B|C|D runs one part; KV_MEM, RATES, NUM for parts C, D)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}; mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
lock() { flock /tmp/goodserve-bench.lock "$@"; }
want() { [ -z "${PART:-}" ] || [ "$PART" = "$1" ]; }
if want A; then
  lock "$py" scripts/kv_dtype_accuracy.py --reference float32 --dtypes bfloat16,int8 \
      --out "$out/accuracy.json" 2>&1 | grep -v ' INFO ' | tee "$out/accuracy.txt"
fi
if want B; then
  for round in ${ROUNDS:-1}; do for ctx in 2048 4096; do for kv in float32 bfloat16 int8; do
    echo "== round $round, context $ctx, kv $kv" | tee -a "$out/decode_step.txt"
    lock "$py" -m goodserve.cli bench micro --decode-context "$ctx" --decode-batches 1,4 --prefill-len 16 \
        --steps 8 --kv-cache-dtype "$kv" --output-json "$out/decode_${ctx}_${kv}_r$round.json" 2>&1 \
        | grep -v ' INFO ' | tee -a "$out/decode_step.txt"
  done; done; done
  if [ -n "${LLAMA_BIN:-}" ]; then  # llama.cpp on the same GGUF: f16 vs q8_0 KV, decode at the same depths
    model=$("$py" -c 'from goodserve.models.loader import default_model_path; print(default_model_path())')
    for round in 1 2; do for kv in f16 q8_0; do
      lock "$LLAMA_BIN/llama-bench" -m "$model" -t 2 -fa on -p 0 -n 32 -d 2048,4096 -ctk "$kv" -ctv "$kv" \
          -o md 2>/dev/null | tee -a "$out/decode_step_llama.txt"
    done; done
  fi
fi
if want C; then
  mem=${KV_MEM:-33554432}; rates=${RATES:-0.15,0.3}; num=${NUM:-16}
  serve="{python} -m goodserve.cli serve --port {port} --kv-cache-memory $mem"
  lock "$py" -m goodserve.cli bench compare --launch "$serve --kv-cache-dtype int8" --label int8 \
      --baseline-launch "$serve --kv-cache-dtype bfloat16" --baseline-label bfloat16 \
      --dataset azure-conv --max-input-len 1024 --max-output-len 128 --num-prompts "$num" --request-rates "$rates" \
      --goodput ttft:5000 tpot:200 --seed 0 --num-warmups 1 --interleave --no-progress \
      --save-result "$out/served.json" 2>&1 | grep -v ' INFO ' | tee "$out/served.txt"
fi
if want D && [ -n "${LLAMA_BIN:-}" ]; then
  mem=${KV_MEM:-33554432}; rates=${RATES:-0.15,0.3}; num=${NUM:-16}
  model=$("$py" -c 'from goodserve.models.loader import default_model_path; print(default_model_path())')
  ctx=$(( mem / (2 * 30 * 3 * 68) / 16 * 16 ))  # whole blocks of 16, as goodserve's pool
  lock "$py" -m goodserve.cli bench compare \
      --launch "{python} -m goodserve.cli serve --port {port} --kv-cache-memory $mem --kv-cache-dtype int8" \
      --label goodserve-int8 \
      --baseline-launch "$LLAMA_BIN/llama-server -m $model -c $ctx -np 16 -cb --kv-unified -ctk q8_0 -ctv q8_0 -fa on -t 2 --host 127.0.0.1 --port {port}" \
      --baseline-label llama-q8_0 \
      --dataset azure-conv --max-input-len 1024 --max-output-len 128 --num-prompts "$num" --request-rates "$rates" \
      --goodput ttft:5000 tpot:200 --seed 0 --num-warmups 1 --interleave --no-progress \
      --save-result "$out/served_llama.json" 2>&1 | grep -v ' INFO ' | tee "$out/served_llama.txt"
fi
