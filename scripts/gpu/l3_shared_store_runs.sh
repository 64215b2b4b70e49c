#!/usr/bin/env bash
# Runs on one H200 in the one-GPU test mode of docs/gpu.md (SMOKE_ONE_GPU=1: its three servers share
# device 0), the project installed or staged with mooncake
# (build_stage.sh --pd: mooncake-transfer-engine-cuda13 and sglang-router): two shared-KV servers on
# one Mooncake Store (scripts/glm5_cp_l3_shared_store_smoke.py, docs/hicache-storage.md "Several
# servers, one Mooncake Store") on the tiny GLM-5, dummy weights, KV audits on, the server's default
# decode: server a at CP 2 computes, server b at each CP size of STORE_TPS_B (default 2) hits,
# with A up, through the router, and after A stopped; the store is our own master and holder.
#
#   SMOKE_ONE_GPU=1 bash scripts/gpu/l3_shared_store_runs.sh                  # b at CP 2
#   SMOKE_ONE_GPU=1 STORE_TPS_B=4 bash scripts/gpu/l3_shared_store_runs.sh    # b at CP 4, a call of its own
#
# One GPU: a run at CP 2 has 6 rank processes (a, b, the reference), one at CP 4 has 10; both at once
# (16) would time-slice the GPU and its 16 cores past one call, as the serve smoke's CP 4 waves did
# (docs/gpu.md), so each CP size of b is a call of its own.
#
# Environment (all optional):
#   STORE_TPS_B="2"     b's CP sizes, one smoke each (a at CP 2, b, a stock reference at b's CP size)
#   STORE_SERIAL=1      one after the other (default: all at once, to fit one call; the TTFTs are
#                       "one GPU, time-sliced" in any case)
#   STORE_BUDGET_S=S    every smoke stopped after S seconds (default 540)
#   STORE_DRY_RUN=1     print each smoke's processes and plan, launch nothing (no GPU, remote_env.sh not sourced)
#   STORE_ROUTER=0      no router phase (default: sglang_router in front of a and b)
#   STORE_DECODE=D      --decode of a and b: server-default (default), per_owner or gather
#   STORE_CUDA_GRAPHS=G --cuda-graphs of a and b: auto (default), on or off
# Output: one "PASSED|FAILED l3_shared_store_a2_bN" line per CP size (the decode a and b logged, B's
# L3 hit rate with A up and after A stopped, restored rows, objects in the holder, pool audit, values,
# router, TTFT from L3 vs recomputed; a process that did not start: why), logs and reports under
# $OUT (store_logs.tgz, store_reports.tgz, store_server_logs.tgz).
set -uo pipefail
ONE_GPU="${SMOKE_ONE_GPU:-}"
[[ -z "$ONE_GPU" || "$ONE_GPU" == 1 ]] || { echo "SMOKE_ONE_GPU must be 1 or unset" >&2; exit 2; }
[[ "${STORE_ROUTER:-1}" == 0 || "${STORE_ROUTER:-1}" == 1 ]] || { echo "STORE_ROUTER must be 0 or 1" >&2; exit 2; }
BUDGET_S="${STORE_BUDGET_S:-540}"
SKIP_STAGED_ENV="${STORE_DRY_RUN:-}" source scripts/gpu/runner_env.sh || exit 1
OUT="${OUT:-/tmp/store_out}"
RUNS="${STORE_RUNS_DIR:-/tmp/store_runs}"
MODEL="${SMOKE_MODEL_DIR:-/tmp/tiny-glm5}"
mkdir -p "$OUT" "$RUNS"
[[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --no-check >/dev/null
if [[ -z "${STORE_DRY_RUN:-}" ]] && ! python3 -c "import mooncake.store" 2>"$OUT/mooncake_import.log"; then
  for tp in ${STORE_TPS_B:-2}; do
    echo "FAILED l3_shared_store_a2_b$tp: mooncake.store does not import ($(tail -1 "$OUT/mooncake_import.log")); stage with build_stage.sh --pd"
  done
  exit 1
fi
start_s=$(date +%s)
run_one() {  # run_one TP_B
  local name="l3_shared_store_a2_b$1"
  [[ -n "${STORE_DRY_RUN:-}" ]] || rm -rf "${RUNS:?}/$name"
  timeout -s TERM -k 45 "$BUDGET_S" python3 scripts/glm5_cp_l3_shared_store_smoke.py --model-path "$MODEL" \
    --tp-a 2 --tp-b "$1" --load-format dummy --mem-fraction-static 0.85 --extra-server-args "--grammar-backend none" \
    --ignore-log-pattern "Can not initialize OpenAIServingResponses" \
    --decode "${STORE_DECODE:-server-default}" --cuda-graphs "${STORE_CUDA_GRAPHS:-auto}" \
    $([[ "${STORE_ROUTER:-1}" == 1 ]] && echo --router) \
    --out-dir "$RUNS/$name" ${ONE_GPU:+--one-gpu} ${STORE_DRY_RUN:+--dry-run} > "$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(( $(date +%s) - start_s )) s)"
}
for tp in ${STORE_TPS_B:-2}; do
  if [[ -n "${STORE_SERIAL:-}" ]]; then run_one "$tp"; else run_one "$tp" & fi
done
wait
if [[ -n "${STORE_DRY_RUN:-}" ]]; then cat "$OUT"/l3_shared_store_a2_b*.log; exit 0; fi
(cd "$RUNS" && tar -czf "$OUT/store_reports.tgz" --ignore-failed-read */report.json 2>/dev/null)
(cd "$RUNS" && tar -czf "$OUT/store_server_logs.tgz" --ignore-failed-read */server_*.log */mooncake_*.log */router.log 2>/dev/null)
echo "== verdicts (${ONE_GPU:+all ranks on one GPU; }$(( $(date +%s) - start_s )) s)"
rc=0
for tp in ${STORE_TPS_B:-2}; do
  grep -E "^FAIL " "$OUT/l3_shared_store_a2_b$tp.log" | head -5 | cut -c1-300
  line="$(grep -E "^(PASSED|FAILED) l3_shared_store_" "$OUT/l3_shared_store_a2_b$tp.log" | tail -1)"
  echo "${line:-FAILED l3_shared_store_a2_b$tp: no verdict (killed by the budget, or crashed; see store_logs.tgz)}"
  [[ "$line" == PASSED* ]] || rc=1
done
(cd "$OUT" && tar -czf store_logs.tgz --ignore-failed-read -- l3_shared_store_a2_b*.log 2>/dev/null)
exit $rc
