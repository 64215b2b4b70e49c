#!/usr/bin/env bash
# The served soak (scripts/glm5_cp_hicache_soak.py; docs/gpu.md, "Soak") in one call on one H200, in
# the one-GPU test mode: four shared-KV servers at once, tiny GLM-5, dummy weights, the server's default
# decode (per owner under CUDA graphs with bf16 KV, as the README launches it), read audits and tree
# dumps on, each under SOAK_DURATION_S of load with aborts and flushes:
#
#   cp2_write_through   --tp 2, --hicache-write-policy write_through
#   cp2_write_back      --tp 2, write_back
#   cp4_write_through   --tp 4, write_through
#   plant_cp2_skip-load-ack   --tp 2, write_through, rank 1 keeps every load-back's lock: must FAIL
#   plant_cp2_load-back-wrong-page   only when SOAK_ONLY names it (12 rank processes with the four
#                       above): rank 1 loads pages back one page off; the pool self-consistency must FAIL
#
# 10 rank processes on the GPU at once (each ~8-9 GB with pools capped at --max-total-tokens 16384).
#
# Usage: bash scripts/gpu/soak_runs.sh            (results under $OUT, default /tmp/soak_out)
# Environment (all optional):
#   SOAK_DURATION_S=S   load per soak (default 180)
#   SOAK_BUDGET_S=S     the whole call within S seconds (default 540): each soak is stopped (SIGTERM
#                       stops its server) when it ends
#   SOAK_ONLY="a b"     run only the soaks with these names
#   SOAK_DECODE=D       every soak's --decode: server-default (default: no decode setting), per_owner or
#                       gather (named in the servers' environment; gather serves without CUDA graphs)
#   SOAK_CUDA_GRAPHS=G  every soak's --cuda-graphs: auto (default: graphs wherever decode runs per
#                       owner), on or off
#   SOAK_DRY_RUN=1      each soak prints its server command and plan, starts nothing (no GPU needed)
#   SMOKE_ONE_GPU=0     every rank on its own GPU instead (4 GPUs for the CP 4 soak)
# Output: per soak its VERDICT line (naming the decode its server logged) and table row, then "SOAK VERDICT: ..." (every clean soak PASS, the
# plant FAIL); logs in $OUT/soak_logs.tgz, reports in $OUT/reports.tgz.
set -uo pipefail
DURATION="${SOAK_DURATION_S:-180}"
BUDGET_S="${SOAK_BUDGET_S:-540}"
ONE_GPU="${SMOKE_ONE_GPU:-1}"
[[ "$ONE_GPU" == 0 || "$ONE_GPU" == 1 ]] || { echo "SMOKE_ONE_GPU must be 0 or 1" >&2; exit 2; }
[[ "$ONE_GPU" == 1 ]] && export SMOKE_ONE_GPU=1 || unset SMOKE_ONE_GPU
start_s=$(date +%s)
SKIP_STAGED_ENV="${SOAK_DRY_RUN:-}" source scripts/gpu/runner_env.sh || exit 1
OUT="${OUT:-/tmp/soak_out}"
RUNS="${SOAK_RUNS_DIR:-/tmp/soak_runs}"
MODEL="${SMOKE_MODEL_DIR:-/tmp/tiny-glm5}"
mkdir -p "$OUT" "$RUNS"
[[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --no-check >/dev/null
selected() { [[ -z "${SOAK_ONLY:-}" || " $SOAK_ONLY " == *" $1 "* ]]; }
named() { [[ " ${SOAK_ONLY:-} " == *" $1 "* ]]; }
STARTED=()
soak() {  # soak NAME TP ARGS...: one soak in the background, log under $OUT
  local name=$1 tp=$2; shift 2
  selected "$name" || return 0
  STARTED+=("$name")
  [[ -n "${SOAK_DRY_RUN:-}" ]] || rm -rf "${RUNS:?}/$name"
  mkdir -p "$RUNS/$name"
  local left=$(( BUDGET_S - ($(date +%s) - start_s) - 30 ))
  timeout -s TERM -k 45 "$left" python3 scripts/glm5_cp_hicache_soak.py --model-path "$MODEL" --tp "$tp" \
    --load-format dummy --mem-fraction-static 0.85 --startup-timeout 300 --duration-s "$DURATION" \
    --out-dir "$RUNS/$name" --name "$name" --ignore-log-pattern "Can not initialize OpenAIServingResponses" \
    --decode "${SOAK_DECODE:-server-default}" --cuda-graphs "${SOAK_CUDA_GRAPHS:-auto}" \
    ${SOAK_DRY_RUN:+--dry-run} ${SMOKE_ONE_GPU:+--one-gpu} "$@" > "$OUT/$name.log" 2>&1 &
}
GRAMMAR="--extra-server-args=--grammar-backend none"
soak cp2_write_through 2 --write-policy write_through "$GRAMMAR"
soak cp2_write_back 2 --write-policy write_back "$GRAMMAR"
soak cp4_write_through 4 --write-policy write_through "$GRAMMAR"
soak plant_cp2_skip-load-ack 2 --write-policy write_through --plant skip-load-ack "$GRAMMAR"
named plant_cp2_load-back-wrong-page && \
  soak plant_cp2_load-back-wrong-page 2 --write-policy write_through --plant load-back-wrong-page "$GRAMMAR"
wait
if [[ -n "${SOAK_DRY_RUN:-}" ]]; then
  for name in "${STARTED[@]}"; do echo "== $name"; grep -v -i "warn" "$OUT/$name.log"; done
  exit 0
fi
echo "== soaks (${SMOKE_ONE_GPU:+all ranks on one GPU, }$(( $(date +%s) - start_s )) s)"
unexpected=()
for name in "${STARTED[@]}"; do
  line=$(grep "^VERDICT:" "$OUT/$name.log" | tail -1)
  grep -E "^\| $name " "$OUT/$name.log" | tail -1
  if [[ "$name" == plant_* ]]; then
    [[ "$line" == "VERDICT: FAIL"* ]] && echo "$line (as it must: the plant was caught)" \
      || { echo "${line:-no VERDICT for $name (killed by the budget, or crashed)}: PLANT NOT CAUGHT"; unexpected+=("$name"); }
  else
    echo "${line:-VERDICT: none for $name (killed by the budget, or crashed; see soak_logs.tgz)}"
    [[ "$line" == "VERDICT: PASS"* ]] || unexpected+=("$name")
  fi
done
(cd "$RUNS" && tar -czf "$OUT/reports.tgz" --ignore-failed-read */report.json */server.log 2>/dev/null)
(cd "$OUT" && tar -czf soak_logs.tgz --ignore-failed-read -- *.log 2>/dev/null && rm -f -- *.log)
if (( ${#unexpected[@]} )); then
  echo "SOAK VERDICT: UNEXPECTED in ${#unexpected[@]} of ${#STARTED[@]} soaks: ${unexpected[*]}"
  exit 1
fi
echo "SOAK VERDICT: all ${#STARTED[@]} soaks as expected (clean soaks PASS, the plant FAIL)"
