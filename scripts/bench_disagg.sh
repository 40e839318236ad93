#!/usr/bin/env bash
# Prefill/decode disaggregation on this 2-core machine, one configuration after the other, same workload:
#   pd:        producer pinned to core 0, consumer to core 1 (one thread each), behind `goodserve router`
#   colocated: one instance on both cores (two threads)
#   replicas:  two one-thread instances (cores 0 and 1) behind the router (least-outstanding-tokens)
# Run it alone on the machine: flock /tmp/goodserve-bench.lock bash scripts/bench_disagg.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-disagg}
RATES=${RATES:-0.25,0.5,1.0}
N=${N:-30}
mkdir -p "$OUT"
G=.venv/bin/goodserve
COMMON=(--max-model-len 2048 --log-stats-interval 0 --served-model-name smollm2)
BENCH=(--dataset azure-code --max-input-len 768 --max-output-len 64 --num-prompts "$N" --num-warmups 2
       --request-rates "$RATES" --goodput ttft:2000 tpot:100 --model smollm2 --no-progress)
pids=()
start() { "$@" & pids+=($!); }
wait_up() { for _ in $(seq 240); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; echo "no $1" >&2; exit 1; }
stop() { kill "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; pids=(); }
trap stop EXIT

# 1. P/D: producer on core 0, consumer on core 1, router in front.
start taskset -c 0 $G serve --port 18101 --num-threads 1 --kv-role producer --step-trace "$OUT/producer.trace" "${COMMON[@]}"
start taskset -c 1 $G serve --port 18102 --num-threads 1 --kv-role consumer --step-trace "$OUT/consumer.trace" "${COMMON[@]}"
wait_up http://127.0.0.1:18101; wait_up http://127.0.0.1:18102
start $G router --port 18100 --prefill http://127.0.0.1:18101 --decode http://127.0.0.1:18102
wait_up http://127.0.0.1:18100
$G bench sweep --base-url http://127.0.0.1:18100 --label pd "${BENCH[@]}" --save-result "$OUT/pd.json"
curl -s http://127.0.0.1:18102/metrics | grep -E '^goodserve:kv_transfer_(bytes|seconds)_(sum|count)' > "$OUT/consumer_kv_metrics.txt"
stop

# 2. One colocated instance, two threads.
start $G serve --port 18103 --num-threads 2 "${COMMON[@]}"
wait_up http://127.0.0.1:18103
$G bench sweep --base-url http://127.0.0.1:18103 --label colocated "${BENCH[@]}" --save-result "$OUT/colocated.json"
stop

# 3. Two one-thread replicas behind the router.
start taskset -c 0 $G serve --port 18104 --num-threads 1 "${COMMON[@]}"
start taskset -c 1 $G serve --port 18105 --num-threads 1 "${COMMON[@]}"
wait_up http://127.0.0.1:18104; wait_up http://127.0.0.1:18105
start $G router --port 18106 --replica http://127.0.0.1:18104 --replica http://127.0.0.1:18105 --routing least-outstanding-tokens
wait_up http://127.0.0.1:18106
$G bench sweep --base-url http://127.0.0.1:18106 --label replicas "${BENCH[@]}" --save-result "$OUT/replicas.json"
stop
