#!/usr/bin/env bash
# Runs on a machine with BENCH_TP GPUs and the project installed (README; mooncake too for part pd),
# or staged (docs/gpu.md): the serving benchmark
# (benchmark/bench_cp_shared_kv_serving.py, docs/benchmarks.md) on the GLM-5-width model, one server
# at a time on all BENCH_TP GPUs. One part and one mode per call, so each fits a call:
#
#   bash scripts/gpu/bench_serving_runs.sh off|on|both headline|ttft|tpot|pd|capacity [more benchmark arguments]
#
#   headline   the documents workload, phases device and host (--physical-tokens-per-rank 163840), the
#              servers as users launch them (--servers as-launched: stock with CUDA graphs, shared KV
#              with its default decode)
#   ttft       TTFT of an 8K chunk on 0 / 32K / 128K cached tokens, from device and from host
#   tpot       TPOT at 4K / 16K / 64K / 128K context, batch 1 and 32 (add --stock-cuda-graphs for
#              the stock server with CUDA graphs too, and with mode on --per-owner-decode for the
#              shared-KV servers with decode per owner, eager and under CUDA graphs)
#   capacity   (mode ignored: both servers) pools sized by memory alone, no HiCache: logical capacity
#              off vs on against cp x physical and the scratch's documented share
#   capacity-sweep  (SMOKE_ONE_GPU=1 only; mode ignored) part capacity at each CP size of BENCH_TPS
#              (default "2 4 8"), one server at a time, then one table: CP, logical tokens off / on,
#              on / off, each rank's pool (the ranks must agree). BENCH_BUDGET_S (default 510): a CP
#              size that cannot start with 150 s left is skipped, and says so
#   pd         the PD pair on fresh 8K prompts: prefill at --tp BENCH_TP on GPUs 0..BENCH_TP-1, a
#              stock decode at --tp BENCH_TP sharing them (prefill --mem-fraction-static 0.4, decode
#              0.85), a model sized for the prefill's 0.4, 32768 pool tokens per rank
#
# Environment: BENCH_TP (2, 4, 8; default 2), BENCH_WEIGHTS (fp8 | bf16; default fp8), BENCH_DRY_RUN=1
# (fake servers on loopback, no GPU; remote_env.sh not sourced). Results: <mode>_<part>.json (merge
# them with --report-from), .md, .log and the plot under /tmp/bench_out (or OUT).
#
# SMOKE_ONE_GPU=1 (test-only; docs/gpu.md, "One-GPU test mode"): every rank on device 0 (the bench's
# --one-gpu), parts headline and capacity only, on the tiny GLM-5 (BENCH_MODEL_DIR to change it; a
# GLM-5-width model's weights would be counted BENCH_TP times against every rank's budget), each rank
# given --mem-fraction-static 0.85 / BENCH_TP, at least 0.18 (one_gpu.per_rank_mem_fraction), the
# shared-KV server's decode per owner in the capacity part (the tiny model's 4 layers are fewer than
# the CP size at 4 and 8: a scratch that holds one layer of the logical capacity, what gather decode
# needs, would not fit beside the pool). What it gives: capacities (on vs off, the ranks' pool
# sizes must agree) and cache hit rates, which do not depend on timing; timings are of a time-sliced
# GPU and socket collectives, never the cost of shared KV.
set -uo pipefail
mode="${1:?off|on|both}"; part="${2:?headline|ttft|tpot|pd|capacity|capacity-sweep}"; shift 2
SKIP_STAGED_ENV="${BENCH_DRY_RUN:-}" source scripts/gpu/runner_env.sh || exit 1
OUT="${OUT:-/tmp/bench_out}"
RUNS="${BENCH_RUNS_DIR:-/tmp/bench_runs}"
if [[ "$part" == capacity-sweep ]]; then
  [[ -n "${SMOKE_ONE_GPU:-}" ]] || { echo "capacity-sweep: SMOKE_ONE_GPU=1 only (every CP size on one GPU)" >&2; exit 2; }
  start_s=$(date +%s); results=()
  for tp in ${BENCH_TPS:-2 4 8}; do
    left=$(( ${BENCH_BUDGET_S:-510} - ($(date +%s) - start_s) ))
    results+=("$RUNS/capacity_cp$tp/both_capacity/results.json")
    if (( left < 150 )); then echo "capacity cp $tp: SKIPPED (budget: ${left} s left)"; continue; fi
    rm -rf "${RUNS:?}/capacity_cp$tp"
    BENCH_TP=$tp BENCH_RUNS_DIR="$RUNS/capacity_cp$tp" OUT="$OUT/capacity_cp$tp" \
      timeout -s TERM -k 30 $(( left - 20 )) bash "$0" both capacity "$@" | grep -E "^\[capacity|^capacity|exit"
  done
  python3 -m sglang_cp_shared_kv_testing.e2e.capacity_sweep "${results[@]}" | tee "$OUT/capacity_sweep.md"
  exit "${PIPESTATUS[0]}"
fi
TP="${BENCH_TP:-2}"
WEIGHTS="${BENCH_WEIGHTS:-fp8}"
GPUS="$(seq -s, 0 $(( TP - 1 )))"
MODEL="${BENCH_MODEL_DIR:-/tmp/glm5-width-bench-tp$TP-$WEIGHTS}"
PD_MODEL="${BENCH_PD_MODEL_DIR:-/tmp/glm5-width-pd-tp$TP-$WEIGHTS}"
MEM=0.85
one_gpu=()
if [[ -n "${SMOKE_ONE_GPU:-}" ]]; then
  [[ "$part" == headline || "$part" == capacity ]] || { echo "SMOKE_ONE_GPU: parts headline and capacity only" >&2; exit 2; }
  MODEL="${BENCH_MODEL_DIR:-/tmp/tiny-glm5}"
  MEM="$(python3 -c "import sys; sys.path.insert(0, 'python'); from sglang_cp_shared_kv_testing.e2e.one_gpu import per_rank_mem_fraction as f; print(f(0.85, $TP))")"
  one_gpu=(--one-gpu)
fi
mkdir -p "$OUT" "$RUNS"
if [[ -n "${SMOKE_ONE_GPU:-}" ]]; then
  [[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --no-check >/dev/null
else
  [[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --glm5-width --tp "$TP" \
    --weights "$WEIGHTS" --mem-fraction-static 0.85 --physical-tokens-per-rank 196608 --no-check
fi
case "$part" in
  headline) part_args=(--parts headline --physical-tokens-per-rank 163840 --servers as-launched) ;;
  ttft|tpot) part_args=(--parts "$part" --physical-tokens-per-rank 163840 --repeats 2) ;;
  capacity) part_args=(--parts capacity)
    [[ -n "${SMOKE_ONE_GPU:-}" ]] && part_args+=(--capacity-decode per_owner) ;;
  pd)
    [[ -f $PD_MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$PD_MODEL" --glm5-width --tp "$TP" \
      --weights "$WEIGHTS" --mem-fraction-static 0.4 --physical-tokens-per-rank 65536 --no-check
    part_args=(--parts pd --pd-model-path "$PD_MODEL" --physical-tokens-per-rank 32768 --pd-prefill-gpus "$GPUS"
               --pd-decode-gpus "$GPUS" --pd-decode-tp "$TP") ;;
  *) echo "part must be headline, ttft, tpot, pd or capacity" >&2; exit 2 ;;
esac
name="${mode}_${part}"
python3 benchmark/bench_cp_shared_kv_serving.py --model-path "$MODEL" --tp "$TP" --load-format dummy \
  --shared-kv "$mode" "${part_args[@]}" --mem-fraction-static "$MEM" --startup-timeout 420 "${one_gpu[@]}" \
  --extra-server-args "--grammar-backend none" --out-dir "$RUNS/$name" --doc-out "$OUT/$name.md" \
  ${BENCH_DRY_RUN:+--dry-run} "$@" > "$OUT/$name.log" 2>&1
rc=$?
[[ -f "$RUNS/$name/results.json" ]] && cp "$RUNS/$name/results.json" "$OUT/$name.json"
logs=("$RUNS/$name"/*.log)  # tar does not expand a pattern when it creates an archive
[[ -e "${logs[0]}" ]] && tar -C "$RUNS/$name" -czf "$OUT/${name}_server_logs.tgz" "${logs[@]##*/}"
grep -E "^\[|^phase|FAIL|^DONE|^FAILED|^error" "$OUT/$name.log" | grep -vE "/[0-9]+ requests" | cut -c1-300
grep -E "/[0-9]+ requests" "$OUT/$name.log" | tail -4
echo "bench $name: exit $rc"
exit $rc
