#!/usr/bin/env bash
# Speculative decoding (issue 33), one job, every comparison interleaved, under the bench lock:
#   A. batch 1 on the code-copy workload (real source code to reproduce; azure-code prompt lengths):
#      goodserve without speculation vs n-gram speculation (auto length, up to 8 drafts), then llama.cpp's
#      llama-server without vs with its own n-gram speculation (--spec-type ngram-simple), same GGUF.
#   B. served goodput at three rates: auto vs off, fixed k=4 vs fixed k=2, then auto vs fixed k=4 (PAIRS picks;
#      k4_off, fixed k=4 vs off, on request).
# Usage: scripts/bench_speculation.sh OUT_DIR   (LLAMA_BIN: llama.cpp's bin folder, see
# ../shared/tools/build-llama-server.sh; PART=A or B to run one part; RATES, NUM, PAIRS for part B; DATASET
# for another workload than code-copy; SPEC for another --speculative-config than n-gram's, e.g. a draft model's
# made by scripts/make_layer_draft.py, braces doubled; TARGET for another served model than the default, e.g. the
# default model's dequantized copy with the default GGUF as its draft)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}; mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
model=$("$py" -c 'from goodserve.models.loader import default_model_path; print(default_model_path())')
# braces doubled: the launch templates are formatted. SPEC: another config (e.g. a draft model's), braces doubled too
ngram8=${SPEC:-'{{"method": "ngram", "num_speculative_tokens": 8}}'}
# the goodput SLOs, which auto reads
serve="{python} -m goodserve.cli serve ${TARGET:+--model $TARGET }--port {port} --slo-ttft 5 --slo-tpot 0.2"
common=(--dataset "${DATASET:-code-copy}" --max-input-len 1024 --max-output-len 256 --seed 0 --num-warmups 1
        --interleave --no-progress)
run() { flock /tmp/goodserve-bench.lock "$py" -m goodserve.cli bench compare "$@"; }
if [ "${PART:-A}" = A ]; then
  run --launch "$serve --speculative-config '$ngram8'" --label ngram-auto \
      --baseline-launch "$serve" --baseline-label off \
      "${common[@]}" --num-prompts 12 --max-concurrency 1 --request-rates inf \
      --save-result "$out/batch1_goodserve.json" 2>&1 | grep -v ' INFO ' | tee "$out/batch1_goodserve.txt"
  if [ -n "${LLAMA_BIN:-}" ]; then
    ls="$LLAMA_BIN/llama-server -m $model -c 4096 -np 1 -t 2 --host 127.0.0.1 --port {port}"
    run --launch "$ls --spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8" \
        --label llama-ngram --baseline-launch "$ls" --baseline-label llama-off \
        "${common[@]}" --num-prompts 12 --max-concurrency 1 --request-rates inf \
        --save-result "$out/batch1_llama.json" 2>&1 | grep -v ' INFO ' | tee "$out/batch1_llama.txt"
  fi
fi
if [ "${PART:-B}" = B ]; then
  rates=${RATES:-0.15,0.3,0.6}; num=${NUM:-20}
  slo=(--goodput ttft:5000 tpot:200)
  pairs=${PAIRS:-auto_off,k4_k2,auto_k4}
  want() { [[ ,$pairs, == *,$1,* ]]; }
  if want auto_off; then
  run --launch "$serve --speculative-config '$ngram8'" --label auto --baseline-launch "$serve" --baseline-label off \
      "${common[@]}" "${slo[@]}" --num-prompts "$num" --request-rates "$rates" \
      --save-result "$out/served_auto_off.json" 2>&1 | grep -v ' INFO ' | tee "$out/served_auto_off.txt"
  fi
  if want k4_k2; then
  run --launch "$serve --speculative-config '$ngram8' --speculative-length 4" --label k4 \
      --baseline-launch "$serve --speculative-config '$ngram8' --speculative-length 2" --baseline-label k2 \
      "${common[@]}" "${slo[@]}" --num-prompts "$num" --request-rates "$rates" \
      --save-result "$out/served_k4_k2.json" 2>&1 | grep -v ' INFO ' | tee "$out/served_k4_k2.txt"
  fi
  if want k4_off; then
  run --launch "$serve --speculative-config '$ngram8' --speculative-length 4" --label k4 \
      --baseline-launch "$serve" --baseline-label off \
      "${common[@]}" "${slo[@]}" --num-prompts "$num" --request-rates "$rates" \
      --save-result "$out/served_k4_off.json" 2>&1 | grep -v ' INFO ' | tee "$out/served_k4_off.txt"
  fi
  if want auto_k4; then
  run --launch "$serve --speculative-config '$ngram8'" --label auto \
      --baseline-launch "$serve --speculative-config '$ngram8' --speculative-length 4" --baseline-label k4 \
      "${common[@]}" "${slo[@]}" --num-prompts "$num" --request-rates "$rates" \
      --save-result "$out/served_auto_k4.json" 2>&1 | grep -v ' INFO ' | tee "$out/served_auto_k4.txt"
  fi
fi
