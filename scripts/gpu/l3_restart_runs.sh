#!/usr/bin/env bash
# Runs on one H200 (SMOKE_ONE_GPU=1, the one-GPU test mode of docs/gpu.md) or on a machine with
# L3_TPS's largest CP size in GPUs, the project installed or staged: the served L3 restart
# (scripts/glm5_cp_l3_restart_smoke.py, docs/hicache-storage.md "Served restart") on the tiny GLM-5,
# dummy weights, the file backend, KV audits on, the server's default decode (per owner under CUDA
# graphs with bf16 KV, as the README launches it), at each CP size of L3_TPS (default "2 4").
#
#   SMOKE_ONE_GPU=1 bash scripts/gpu/l3_restart_runs.sh
#
# Environment (all optional):
#   L3_TPS="2 4"     CP sizes, one restart smoke each (three servers: write, restart, recompute)
#   L3_SERIAL=1      one CP size after the other (default: all at once, to fit one call; their servers
#                    then share the GPU, so the TTFTs are noisier still; they are "one GPU, time-sliced"
#                    in any case)
#   L3_BUDGET_S=S    every smoke stopped after S seconds (default 500)
#   L3_DRY_RUN=1     print each smoke's servers and plan, launch nothing (no GPU, remote_env.sh not sourced)
#   L3_DECODE=D      every server's --decode: server-default (default: no decode setting), per_owner or
#                    gather (named in the servers' environment; gather serves without CUDA graphs)
#   L3_CUDA_GRAPHS=G every server's --cuda-graphs: auto (default: graphs wherever decode runs per owner),
#                    on or off
# Output: one "PASSED|FAILED l3_restart_cpN" line per CP size (the decode the servers logged, hit tokens,
# restored rows, pool audit, TTFT from L3 vs recomputed; a server that did not start: its error), logs and reports under $OUT (l3_logs.tgz, l3_reports.tgz).
set -uo pipefail
ONE_GPU="${SMOKE_ONE_GPU:-}"
[[ -z "$ONE_GPU" || "$ONE_GPU" == 1 ]] || { echo "SMOKE_ONE_GPU must be 1 or unset" >&2; exit 2; }
BUDGET_S="${L3_BUDGET_S:-500}"
SKIP_STAGED_ENV="${L3_DRY_RUN:-}" source scripts/gpu/runner_env.sh || exit 1
OUT="${OUT:-/tmp/l3_out}"
RUNS="${L3_RUNS_DIR:-/tmp/l3_runs}"
MODEL="${SMOKE_MODEL_DIR:-/tmp/tiny-glm5}"
mkdir -p "$OUT" "$RUNS"
[[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --no-check >/dev/null
start_s=$(date +%s)
run_one() {  # run_one TP
  local name="l3_restart_cp$1"
  [[ -n "${L3_DRY_RUN:-}" ]] || rm -rf "${RUNS:?}/$name"  # a fresh storage directory every call
  timeout -s TERM -k 45 "$BUDGET_S" python3 scripts/glm5_cp_l3_restart_smoke.py --model-path "$MODEL" --tp "$1" \
    --load-format dummy --mem-fraction-static 0.85 --extra-server-args "--grammar-backend none" \
    --ignore-log-pattern "Can not initialize OpenAIServingResponses" \
    --decode "${L3_DECODE:-server-default}" --cuda-graphs "${L3_CUDA_GRAPHS:-auto}" \
    --out-dir "$RUNS/$name" ${ONE_GPU:+--one-gpu} ${L3_DRY_RUN:+--dry-run} > "$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(( $(date +%s) - start_s )) s)"
}
for tp in ${L3_TPS:-2 4}; do
  if [[ -n "${L3_SERIAL:-}" ]]; then run_one "$tp"; else run_one "$tp" & fi
done
wait
if [[ -n "${L3_DRY_RUN:-}" ]]; then cat "$OUT"/l3_restart_cp*.log; exit 0; fi
(cd "$RUNS" && tar -czf "$OUT/l3_reports.tgz" --ignore-failed-read */report.json 2>/dev/null)
(cd "$RUNS" && tar -czf "$OUT/l3_server_logs.tgz" --ignore-failed-read */server_*.log 2>/dev/null)
echo "== verdicts (${ONE_GPU:+all ranks on one GPU; }$(( $(date +%s) - start_s )) s)"
rc=0
for tp in ${L3_TPS:-2 4}; do
  grep -E "^FAIL " "$OUT/l3_restart_cp$tp.log" | head -5 | cut -c1-300
  line="$(grep -E "^(PASSED|FAILED) l3_restart_cp" "$OUT/l3_restart_cp$tp.log" | tail -1)"
  echo "${line:-FAILED l3_restart_cp$tp: no verdict (killed by the budget, or crashed; see l3_logs.tgz)}"
  [[ "$line" == PASSED* ]] || rc=1
done
(cd "$OUT" && tar -czf l3_logs.tgz --ignore-failed-read -- l3_restart_cp*.log 2>/dev/null)
exit $rc
