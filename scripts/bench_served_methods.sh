#!/usr/bin/env bash
# Speculation through the server: one `draftwise serve` per method (plain, ngram, draft model, suffix; k auto), then
# `draftwise bench --endpoint` against all of them at one concurrency, so each method is measured as a served
# user sees it (HTTP, streaming, the engine in its own process) in one interleaved run.
#
# The servers start one at a time, each healthy before the next starts: a server times its kernels and its step-cost
# grid while it loads (kernels/autotune.py, kernels/step_cost.py), and four loading together time each other's
# load instead (measured 2026-12-07: chat at 4 clients, the draft model 0.94x plain with acceptance 0.48 when
# started together, 1.00x with 0.71 one at a time; docs/PERFORMANCE.md). Extra arguments go to `draftwise bench`.
#
#   scripts/bench_served_methods.sh --workload code,chat --concurrency 4 --requests 30 --warmup 1 --out /tmp/served
#   METHODS="none suffix" PORT=8200 scripts/bench_served_methods.sh --workload chat --requests 8
#
# Environment: METHODS (default "none ngram draft_model suffix"), DRAFT (the draft model, default
# qwen2.5-coder-0.5b-instruct), MAX_NUM_SEQS (default 4), PORT (the first port, default 8101), DRAFTWISE (the
# command, default .venv/bin/draftwise), LOGS (the servers' logs, default a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
DW=${DRAFTWISE:-.venv/bin/draftwise}
METHODS=${METHODS:-none ngram draft_model suffix}
DRAFT=${DRAFT:-qwen2.5-coder-0.5b-instruct}
LOGS=${LOGS:-$(mktemp -d)}
port=${PORT:-8101}
pids=()
endpoints=()
stop() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop EXIT
for m in $METHODS; do
  case $m in
    none) spec=() ;;
    ngram | suffix) spec=(--speculative-config "{\"method\":\"$m\",\"num_speculative_tokens\":\"auto\"}") ;;
    draft_model) spec=(--speculative-config "{\"method\":\"draft_model\",\"model\":\"$DRAFT\",\"num_speculative_tokens\":\"auto\"}") ;;
    *) echo "bench_served_methods: unknown method '$m' (none, ngram, draft_model, suffix)" >&2; exit 2 ;;
  esac
  "$DW" serve --port "$port" --max-num-seqs "${MAX_NUM_SEQS:-4}" --no-engine-standby "${spec[@]}" > "$LOGS/serve_$m.log" 2>&1 &
  pids+=($!)
  echo "bench_served_methods: starting $m on port $port (log $LOGS/serve_$m.log)" >&2
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "bench_served_methods: the $m server exited; its log:" >&2; tail -20 "$LOGS/serve_$m.log" >&2; exit 1; }
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" > /dev/null || { echo "bench_served_methods: $m not healthy after 600 s" >&2; exit 1; }
  endpoints+=(--endpoint "$m=http://127.0.0.1:$port")
  port=$((port + 1))
done
"$DW" bench "${endpoints[@]}" "$@"
