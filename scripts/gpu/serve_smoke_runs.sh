#!/usr/bin/env bash
# Runs on a machine with two GPUs (four or eight with SMOKE_TP 4 / 8) and the project installed
# (README), or staged (docs/gpu.md, "Staging an offline machine"): the end-to-end smoke of
# `sglang serve` at --tp 2 (SMOKE_TP: 4, 8) with the tiny GLM-5 (SMOKE_MODEL: GLM-5's widths),
# dummy weights. docs/gpu.md, "Serve smoke", says what each mode prints and what passes.
#
#   correctness   reference servers (shared KV off) and shared-KV servers, all at once (each server
#                 spans both GPUs; pools are capped by --max-total-tokens), with the KV audits on:
#                 bf16 write_through + chunked prefill + a burst of 12; bf16 write_back; bf16 radix
#                 cache only (against a radix-only reference); fp8 write_through; bf16 without the
#                 overlap scheduler. Each shared-KV run compares its pool dumps with its
#                 reference's and checks its read audit.
#   plants        shared-KV runs with a planted bug (bf16; fp8 for the per-owner decode plant); each
#                 must FAIL (the oracle catches it).
#   perf          shared KV off, then on, alone on the machine, audits off: TTFT of 16K-token prefixes
#                 from host vs recomputed, TPOT at 4K / 16K / 64K tokens of context.
#
#   confirm       the bf16 write_through/chunked/burst and fp8 runs with their references only.
#
#   mtp           MTP on every server (--mtp: EAGLE with the NextN layer, 3 steps, top-k 1, 4 draft
#                 tokens, and the shared-KV opt-in), the tiny GLM-5 with its NextN layer
#                 (make_tiny_glm5_config.py --nextn): a stock MTP reference with HiCache (bf16
#                 write_through + chunked prefill) and the shared-KV runs against it (spec v2, sglang's
#                 default; spec v1 with --disable-overlap-schedule), a radix-only stock fp8 MTP
#                 reference and the fp8 shared-KV run with HiCache against it. Each shared-KV run is
#                 judged as in correctness plus the draft pool's write and read audits and the
#                 cached-prefix ledger; accept lengths are reported.
#   mtp-plants    the two draft plants (draft-wrong-owner, draft-stale-load-back) on bf16 MTP runs
#                 against the mtp mode's bf16 reference (run here too if it is not in the runs dir
#                 yet); each must FAIL.
#
#   decode        the decode paths beside the gather, with the KV audits: per-owner decode eager
#                 (SGLANG_CP_SHARED_KV_DECODE=per_owner, ..._CUDA_GRAPH=0) and under CUDA graphs
#                 (SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH=1, no --disable-cuda-graph, graphs up to
#                 batch 16), bf16 (fa3 per owner) and fp8 (flashmla_kv per owner), the layer-ahead
#                 prefetch on (SGLANG_CP_SHARED_KV_PREFETCH_SLOT_TOKENS=auto) in one bf16 gather run, one
#                 eager and one graph run; a burst of 12 in each (batched decode), against the
#                 references of correctness (run here too); the decode-wrong-page plant eager (fp8)
#                 and under graphs (bf16); each plant must FAIL. (MTP is refused with per-owner decode.)
#   defaults      the shared-KV server as a user launches it: no decode setting in its environment,
#                 no --disable-cuda-graph, sglang's own capture list (bf16 write_through + chunked
#                 prefill, on_bf16_server_default), with a burst of 48 so that batches above 16 replay
#                 their graphs, against its own stock reference with the same burst (ref_bf16_burst48).
#   ttft-chunks   where a fresh prompt's first token goes slower with shared KV (one GPU, 2026-12-03:
#                 median 589 ms against stock's 195 ms with chunked prefill 2048 and 2 audited layers;
#                 no gap in the PD pair's unchunked 8K prompts): stock and shared KV (gather) at
#                 chunked prefill 2048 and 8192, no audits; each verdict line gives the median first-
#                 token times of fresh prompts and of prefixes from host and device (reported only).
#   stock-graphs  stock (shared KV off) with decode CUDA graphs captured only at batch SMOKE_TP and 16,
#                 KV audits on, a burst of 12: every batch of 3 to 15 requests replays padded by 1 to
#                 13 rows. Whether a padded replay fails without shared KV too.
#   padded-graphs per-owner decode graphs replaying padded batches: captured at batch SMOKE_TP and 16
#                 only (every burst batch of 3 to 15 replays padded), CUDA_LAUNCH_BLOCKING=1:
#                 on_bf16_owner_graphs_padded is judged, and diag_padded_eager_replay, reported only,
#                 adds sglang's --debug-cuda-graph (each replay runs the captured forward eagerly on
#                 the graph's static, padded buffers), so a fault names its kernel in the log. Both
#                 against ref_bf16 (run here too).
#   onegpu-core   the most per minute at one SMOKE_TP: the two references, shared KV in gather /
#                 per-owner eager / per-owner graphs, bf16 and fp8 (prefetch on in one run of each
#                 dtype), and four plants (read-wrong-owner, load-back-wrong-page, decode-wrong-page
#                 eager and under graphs); 12 servers. Meant for SMOKE_ONE_GPU=1 (docs/gpu.md, "One-GPU
#                 test mode", gives the expected wall time per SMOKE_TP); SMOKE_ONLY splits it.
#   values        the value audit (every audited run has it; docs/e2e-smoke.md, "Value audit"): the shared-KV
#                 server as a user launches it (on_bf16_server_default) and the value-only plants, which
#                 leave every row right and must be caught by the value audit alone: the merge skew per
#                 owner under graphs and eagerly, the stale graph LSE (only a replay shows it), the scale
#                 of gathered pages (gather path), all against ref_bf16 (run here too). At CP 2 on one GPU
#                 the six servers fit one call; SMOKE_ONLY splits them (the reference's report is reused
#                 from SMOKE_RUNS_DIR when it is not selected).
#   one-exchange  per-owner decode's one-exchange merge (opt-in, SGLANG_CP_SHARED_KV_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES
#                 at SMOKE_ONE_EXCHANGE_BYTES, default the modeled value: every batch at CP 2) with the value
#                 audit: the server as a user launches it plus the setting (sglang's graphs,
#                 on_bf16_one_exchange_default), per owner eagerly (on_bf16_one_exchange_eager), and the
#                 merge-skew plant under graphs, all against ref_bf16 (run here too). Each clean run must
#                 have judged rows merged by the one exchange (replayed ones under graphs); the plant must
#                 be caught by the value audit alone.
#   Every shared-KV run but the defaults mode's names its decode path (SGLANG_CP_SHARED_KV_DECODE
#   gather or per_owner), so none depends on the server's default (auto).
#
# Usage: bash scripts/gpu/serve_smoke_runs.sh correctness|confirm|plants|perf|mtp|mtp-plants|decode|onegpu-core|values|one-exchange|defaults|ttft-chunks|stock-graphs|padded-graphs   (results under $OUT)
#
# Environment (all optional):
#   SMOKE_TP=2|4|8          --tp of every server (= CP size); 8 GPUs needed for 8, 4 for 4
#   SMOKE_MODEL=tiny|glm5-width   the tiny GLM-5 (default) or GLM-5's real widths with as many layers
#                           as SMOKE_TP H200s hold (make_tiny_glm5_config.py --glm5-width, SMOKE_WEIGHTS
#                           bf16|fp8, default fp8); a glm5-width server takes most of every GPU, so its
#                           smokes run one at a time (SMOKE_SERIAL=1 is implied), and the KV audits cover
#                           its first SMOKE_AUDIT_LAYERS layers (default 2; layer 0 is what judges)
#   SMOKE_SERIAL=1          one smoke at a time, in the order listed (references first)
#   SMOKE_ONLY="a b"        run only the smokes with these names (e.g. to split a set over calls)
#   SMOKE_MAX_NEW_TOKENS=N  tokens generated per request (default 16): fewer decode steps where one-GPU
#                           ranks are slow (CP 4 and 8); every run of the call gets the same
#   SMOKE_PHYSICAL_TOKENS_PER_RANK=N   device pool rows per rank (--max-total-tokens, default 16384): the
#                           plan sends about 2 x cp_size x N / 8064 requests, so CP 8 on one GPU runs with
#                           8192; a reference and the runs judged against it must get the same N
#   SMOKE_AUDIT_LAYERS=N    leading layers the audits cover (default: all; 2 with SMOKE_ONE_GPU, where the read
#                           audit's per-forward all-gather of each audited layer's pool over sockets dominated
#                           the shared-KV servers' time; layers 0 and 1 cover both prefetch slots)
#   SMOKE_GRAPH_ARGS="..."  the graph runs' sglang graph arguments (default --cuda-graph-bs 1 2 .. 16)
#   SMOKE_ONE_EXCHANGE_BYTES=N   the one-exchange mode's setting (default: the modeled value, settings.py)
#   SMOKE_DRY_RUN=1         each smoke prints its server commands and request plan and launches
#                           nothing (no GPU needed, remote_env.sh not sourced)
#   SMOKE_NEXTN_MODEL_DIR   the mtp modes' model (default /tmp/tiny-glm5-nextn; tiny model only)
#   SMOKE_ONE_GPU=1         test-only: every rank of every server on device 0 (the smoke plugin's
#                           one-GPU hook, --one-gpu; docs/gpu.md "One-GPU test mode"): SMOKE_TP 2, 4, 8
#                           on one GPU. Pools stay capped by --max-total-tokens; at most SMOKE_PARALLEL
#                           servers at once (default 12 / SMOKE_TP rank processes)
#   SMOKE_PARALLEL=N        at most N smokes at once (default: all, or 12 / SMOKE_TP with SMOKE_ONE_GPU:
#                           a rank process takes 8-9.5 GB, and 16 of them overflowed one H200)
#   SMOKE_SERVER_ENV="NAME:KEY=VALUE ..."   extra environment of the shared-KV server of smoke NAME
#                           (e.g. "on_fp8_owner:CUDA_LAUNCH_BLOCKING=1" to pin an asynchronous CUDA error)
#   SMOKE_BUDGET_S=S        the whole call within S seconds (default 540 with SMOKE_ONE_GPU, else none):
#                           each smoke is stopped (SIGTERM stops its server) when the budget ends, and
#                           a smoke that cannot start with 150 s left is SKIPPED
# Output: per run one line "PASSED|FAILED name: ..." (smoke_verdicts.py) and a VERDICT line; the full
# logs under $OUT (smoke_logs.tgz, server_logs.tgz, reports.tgz).
set -uo pipefail
MODE="${1:?correctness|confirm|plants|perf|mtp|mtp-plants|decode|onegpu-core|values|one-exchange|defaults|ttft-chunks|stock-graphs|padded-graphs}"
TP="${SMOKE_TP:-2}"
SERIAL="${SMOKE_SERIAL:-}"
ONE_GPU="${SMOKE_ONE_GPU:-}"
[[ -z "$ONE_GPU" || "$ONE_GPU" == 1 ]] || { echo "SMOKE_ONE_GPU must be 1 or unset" >&2; exit 2; }
PARALLEL="${SMOKE_PARALLEL:-$([[ -n "$ONE_GPU" ]] && echo $(( TP >= 12 ? 1 : 12 / TP )) || echo 0)}"
BUDGET_S="${SMOKE_BUDGET_S:-$([[ -n "$ONE_GPU" ]] && echo 540)}"
AUDIT_LAYERS="${SMOKE_AUDIT_LAYERS:-$([[ -n "$ONE_GPU" ]] && echo 2)}"
start_s=$(date +%s)
SKIP_STAGED_ENV="${SMOKE_DRY_RUN:-}" source scripts/gpu/runner_env.sh || exit 1
OUT="${OUT:-/tmp/smoke_out}"
RUNS="${SMOKE_RUNS_DIR:-/tmp/smoke_runs}"
mkdir -p "$OUT" "$RUNS"
case "${SMOKE_MODEL:-tiny}" in
  tiny)
    if [[ "$MODE" == mtp* ]]; then  # the draft is the model's NextN layer
      MODEL="${SMOKE_NEXTN_MODEL_DIR:-/tmp/tiny-glm5-nextn}"
      [[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --nextn --no-check >/dev/null
    else
      MODEL="${SMOKE_MODEL_DIR:-/tmp/tiny-glm5}"
      [[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --no-check >/dev/null
    fi ;;
  glm5-width)
    [[ "$MODE" == mtp* ]] && { echo "the mtp modes run the tiny model (SMOKE_MODEL=tiny)" >&2; exit 2; }
    MODEL="${SMOKE_MODEL_DIR:-/tmp/glm5-width-tp$TP}"
    SERIAL=1
    export SGLANG_CP_SHARED_KV_SMOKE_AUDIT_LAYERS="${SMOKE_AUDIT_LAYERS:-2}"
    [[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --glm5-width --tp "$TP" \
      --weights "${SMOKE_WEIGHTS:-fp8}" --mem-fraction-static 0.85 --no-check ;;
  *) echo "SMOKE_MODEL must be tiny or glm5-width" >&2; exit 2 ;;
esac
selected() { [[ -z "${SMOKE_ONLY:-}" || " $SMOKE_ONLY " == *" $1 "* ]]; }
STARTED=()  # names of the smokes started, in order (the verdict lines)
smoke() {  # smoke NAME ARGS...: one smoke process, log under $OUT
  local name=$1; shift
  selected "$name" || return 0
  local limit=() t0 entry extra_env=(); t0=$(date +%s)
  for entry in ${SMOKE_SERVER_ENV:-}; do
    [[ "${entry%%:*}" == "$name" ]] && extra_env+=(--server-env "${entry#*:}")
  done
  [[ -n "${SMOKE_DRY_RUN:-}" ]] || rm -rf "${RUNS:?}/$name"  # no verdict from an earlier call's report
  mkdir -p "$RUNS/$name"
  if [[ -n "$BUDGET_S" ]]; then
    local left=$(( BUDGET_S - (t0 - start_s) - 30 ))
    if (( left < 150 )); then
      echo "skipped 0" > "$RUNS/$name/runner_exit"
      echo "$name: SKIPPED (budget: ${left} s left)"; return 0
    fi
    limit=(timeout -s TERM -k 45 "$left")
  fi
  "${limit[@]}" python3 scripts/glm5_cp_hicache_smoke.py --model-path "$MODEL" --tp "$TP" --load-format dummy \
    --mem-fraction-static 0.85 --startup-timeout 500 --out-dir "$RUNS/$name" \
    --ignore-log-pattern "Can not initialize OpenAIServingResponses" ${SMOKE_DRY_RUN:+--dry-run} \
    ${ONE_GPU:+--one-gpu} ${SMOKE_MAX_NEW_TOKENS:+--max-new-tokens "$SMOKE_MAX_NEW_TOKENS"} \
    ${SMOKE_PHYSICAL_TOKENS_PER_RANK:+--physical-tokens-per-rank "$SMOKE_PHYSICAL_TOKENS_PER_RANK"} \
    ${AUDIT_LAYERS:+--audit-layers "$AUDIT_LAYERS"} "${extra_env[@]}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? took=$(( $(date +%s) - t0 ))
  echo "$rc $took" > "$RUNS/$name/runner_exit"
  echo "$name: exit $rc (${took} s)"
}
spawn() {  # spawn smoke NAME ARGS...: in the background (at most PARALLEL at once), or in turn with SMOKE_SERIAL
  if [[ "$1" == smoke ]]; then
    selected "$2" || return 0
    STARTED+=("$2")
  fi
  if [[ -n "$SERIAL" ]]; then "$@"; return; fi
  while (( PARALLEL > 0 && $(jobs -rp | wc -l) >= PARALLEL )); do wait -n; done
  "$@" &
}
GRAMMAR="--grammar-backend none"
BF16_WT="$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
FP8_WT="$GRAMMAR --kv-cache-dtype fp8_e4m3 --hicache-write-policy write_through"
# per-owner decode graphs: capture every batch size a smoke sends (sglang keeps the multiples of the CP
# size); padded-graphs captures two sizes only
GRAPHS="${SMOKE_GRAPH_ARGS:---cuda-graph-bs $(seq -s ' ' 1 16)}"
# The runs the correctness, decode and onegpu-core modes share (each judged against its reference).
ref_bf16() {
  spawn smoke ref_bf16 --shared-kv off --audit --burst 12 --extra-server-args "$BF16_WT"
}
ref_fp8_radix() {
  spawn smoke ref_fp8_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3"
}
on_bf16() {  # on_bf16 NAME ARGS...: shared KV, bf16 write_through + chunked prefill + burst, against ref_bf16
  local name=$1; shift
  spawn smoke "$name" --shared-kv on --audit --burst 12 --reference-dir "$RUNS/ref_bf16" "$@"
}
on_fp8() {  # on_fp8 NAME ARGS...: shared KV, fp8 write_through + burst, against ref_fp8_radix
  local name=$1; shift
  spawn smoke "$name" --shared-kv on --audit --burst 12 --reference-dir "$RUNS/ref_fp8_radix" "$@"
}
decode_plants() {  # the per-owner decode plant eager (fp8, flashmla_kv) and under graphs (bf16, fa3)
  on_fp8 plant_decode-wrong-page --plant decode-wrong-page --decode per-owner --extra-server-args "$FP8_WT"
  on_bf16 plant_decode-wrong-page_graphs --plant decode-wrong-page --decode per-owner-graphs \
    --extra-server-args "$BF16_WT $GRAPHS"
}
case "$MODE" in
  correctness)
    ref_bf16
    spawn smoke on_bf16_wt_chunked --shared-kv on --audit --burst 12 --reference-dir "$RUNS/ref_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
    spawn smoke on_bf16_wb --shared-kv on --audit --reference-dir "$RUNS/ref_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_back"
    spawn smoke ref_bf16_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR"
    spawn smoke on_bf16_radix --shared-kv on --no-hicache --audit --reference-dir "$RUNS/ref_bf16_radix" \
      --extra-server-args "$GRAMMAR"
    # fp8 against a stock reference that never loads back: stock 0.5.11's NSA host pool corrupts
    # fp8 KV on load-back (docs/cp-hicache.md), which a HiCache reference would count against us.
    spawn smoke ref_fp8_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3"
    spawn smoke on_fp8 --shared-kv on --audit --reference-dir "$RUNS/ref_fp8_radix" \
      --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3 --hicache-write-policy write_through"
    spawn smoke on_bf16_no_overlap --shared-kv on --audit --reference-dir "$RUNS/ref_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --disable-overlap-schedule"
    wait ;;
  decode)
    ref_bf16
    ref_fp8_radix
    on_bf16 on_bf16_gather_prefetch --prefetch-slot-tokens auto --extra-server-args "$BF16_WT"
    on_bf16 on_bf16_owner_prefetch --decode per-owner --prefetch-slot-tokens auto --extra-server-args "$BF16_WT"
    on_bf16 on_bf16_owner_graphs --decode per-owner-graphs --extra-server-args "$BF16_WT $GRAPHS"
    on_fp8 on_fp8_owner --decode per-owner --extra-server-args "$FP8_WT"
    on_fp8 on_fp8_owner_graphs_prefetch --decode per-owner-graphs --prefetch-slot-tokens auto \
      --extra-server-args "$FP8_WT $GRAPHS"
    decode_plants
    wait ;;
  onegpu-core)
    ref_bf16
    ref_fp8_radix
    on_bf16 on_bf16_gather --extra-server-args "$BF16_WT"
    on_bf16 on_bf16_owner_prefetch --decode per-owner --prefetch-slot-tokens auto --extra-server-args "$BF16_WT"
    on_bf16 on_bf16_owner_graphs --decode per-owner-graphs --extra-server-args "$BF16_WT $GRAPHS"
    on_fp8 on_fp8_gather --extra-server-args "$FP8_WT"
    on_fp8 on_fp8_owner --decode per-owner --extra-server-args "$FP8_WT"
    on_fp8 on_fp8_owner_graphs_prefetch --decode per-owner-graphs --prefetch-slot-tokens auto \
      --extra-server-args "$FP8_WT $GRAPHS"
    for bug in read-wrong-owner load-back-wrong-page; do
      on_bf16 "plant_$bug" --plant "$bug" --extra-server-args "$BF16_WT"
    done
    decode_plants
    wait ;;
  values)  # the value audit: the default decode served clean, and value-only plants, each caught by it alone
    ref_bf16
    on_bf16 on_bf16_server_default --decode server-default --extra-server-args "$BF16_WT"
    on_bf16 plant_value-merge-skew_graphs --plant value-merge-skew --decode per-owner-graphs \
      --extra-server-args "$BF16_WT $GRAPHS"
    on_bf16 plant_value-graph-stale-lse_graphs --plant value-graph-stale-lse --decode per-owner-graphs \
      --extra-server-args "$BF16_WT $GRAPHS"
    on_bf16 plant_value-merge-skew --plant value-merge-skew --decode per-owner --extra-server-args "$BF16_WT"
    on_bf16 plant_value-gathered-scale --plant value-gathered-scale --decode gather --extra-server-args "$BF16_WT"
    wait ;;
  one-exchange)  # the opt-in one-exchange merge served with values, and a value plant caught in it
    one_exchange="${SMOKE_ONE_EXCHANGE_BYTES:-$(python3 -c 'from sglang_cp_shared_kv.settings import MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES as b; print(b)')}"
    ref_bf16
    on_bf16 on_bf16_one_exchange_default --decode server-default --merge-one-exchange-max-extra-bytes "$one_exchange" \
      --extra-server-args "$BF16_WT"
    on_bf16 on_bf16_one_exchange_eager --decode per-owner --merge-one-exchange-max-extra-bytes "$one_exchange" \
      --extra-server-args "$BF16_WT"
    on_bf16 plant_value-merge-skew_one_exchange_graphs --plant value-merge-skew --decode per-owner-graphs \
      --merge-one-exchange-max-extra-bytes "$one_exchange" --extra-server-args "$BF16_WT $GRAPHS"
    wait ;;
  defaults)  # a burst of 48: batches of 17-48 replay sglang's graphs of 24 .. 48 (padded between)
    spawn smoke ref_bf16_burst48 --shared-kv off --audit --burst 48 --extra-server-args "$BF16_WT"
    spawn smoke on_bf16_server_default --shared-kv on --audit --burst 48 --reference-dir "$RUNS/ref_bf16_burst48" \
      --decode server-default --extra-server-args "$BF16_WT"
    wait ;;
  ttft-chunks)  # no audits (their collectives are not the product's): first-token times only
    for chunk in 2048 8192; do
      for kv in off on; do
        spawn smoke "ttft_${kv}_c$chunk" --shared-kv $kv \
          --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size $chunk"
      done
    done
    wait ;;
  stock-graphs)
    spawn smoke ref_bf16_stock_graphs --shared-kv off --audit --burst 12 --stock-cuda-graphs \
      --extra-server-args "$BF16_WT --cuda-graph-bs $TP 16"
    wait ;;
  padded-graphs)
    ref_bf16
    for run in on_bf16_owner_graphs_padded diag_padded_eager_replay; do
      debug=""; [[ "$run" == diag_padded_eager_replay ]] && debug="--debug-cuda-graph"
      on_bf16 "$run" --decode per-owner-graphs --server-env CUDA_LAUNCH_BLOCKING=1 \
        --extra-server-args "$BF16_WT --cuda-graph-bs $TP 16 $debug"
    done
    wait ;;
  confirm)  # the bf16 and fp8 shared-KV runs and their references, in one short call
    spawn smoke ref_bf16 --shared-kv off --audit --burst 12 \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
    spawn smoke on_bf16_wt_chunked --shared-kv on --audit --burst 12 --reference-dir "$RUNS/ref_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
    spawn smoke ref_fp8_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3"
    spawn smoke on_fp8 --shared-kv on --audit --reference-dir "$RUNS/ref_fp8_radix" \
      --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3 --hicache-write-policy write_through"
    wait ;;
  plants)
    # fp8: stock 0.5.11's NSA host pool corrupts fp8 KV on load-back (docs/cp-hicache.md), so the fp8
    # shared-KV run is also judged against a stock reference that never loads back (radix only).
    spawn smoke ref_fp8_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3"
    for bug in read-wrong-owner load-back-wrong-page; do
      spawn smoke "plant_$bug" --shared-kv on --audit --plant "$bug" --reference-dir "$RUNS/ref_bf16" \
        --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
    done
    # Per-owner decode (opt-in): the decode read audit must catch a wrong page, eager and in graphs.
    decode_plants
    wait
    python3 - "$RUNS" <<'PY' > "$OUT/fp8_vs_radix_reference.log" 2>&1
import json, sys
sys.path.insert(0, "scripts/smoke_plugin")
from pathlib import Path
from cp_shared_kv_smoke_hooks import kv_audit_compare
runs = Path(sys.argv[1])
r = kv_audit_compare.compare_runs(runs / "on_fp8/audit_shared-kv-on", runs / "ref_fp8_radix/audit_shared-kv-off")
print("on_fp8 vs ref_fp8_radix pool_audit:", json.dumps(r.to_json())[:3000])
r = kv_audit_compare.compare_runs(runs / "ref_fp8/audit_shared-kv-off", runs / "ref_fp8_radix/audit_shared-kv-off")
print("ref_fp8 (stock HiCache) vs ref_fp8_radix pool_audit:", json.dumps(r.to_json())[:3000])
PY
    ;;
  mtp)
    spawn smoke ref_mtp_bf16 --mtp --shared-kv off --audit \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
    spawn smoke on_mtp_bf16_wt_chunked --mtp --shared-kv on --audit --reference-dir "$RUNS/ref_mtp_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
    spawn smoke on_mtp_bf16_spec_v1 --mtp --shared-kv on --audit --reference-dir "$RUNS/ref_mtp_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --disable-overlap-schedule"
    # fp8 against a stock reference that never loads back (stock 0.5.11's NSA host pool corrupts fp8
    # KV on load-back, and leaves the draft of a loaded-back prefix stale).
    spawn smoke ref_mtp_fp8_radix --mtp --shared-kv off --no-hicache --audit \
      --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3"
    spawn smoke on_mtp_fp8 --mtp --shared-kv on --audit --reference-dir "$RUNS/ref_mtp_fp8_radix" \
      --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3 --hicache-write-policy write_through"
    wait ;;
  mtp-plants)
    if [[ -n "${SMOKE_DRY_RUN:-}" || ! -f "$RUNS/ref_mtp_bf16/report.json" ]]; then
      spawn smoke ref_mtp_bf16 --mtp --shared-kv off --audit \
        --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
    fi
    for bug in draft-wrong-owner draft-stale-load-back; do
      spawn smoke "plant_$bug" --mtp --shared-kv on --audit --plant "$bug" --reference-dir "$RUNS/ref_mtp_bf16" \
        --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048"
    done
    wait ;;
  perf)
    for mode in off on; do
      smoke "perf_$mode" --shared-kv $mode --physical-tokens-per-rank 81920 --max-prefix-tokens 32768 \
        --tpot-contexts 4096,16384,65536 --max-new-tokens 8 --extra-server-args "$GRAMMAR --hicache-write-policy write_through"
    done ;;
esac
wait
mkdir -p "$OUT/logs"
for d in "$RUNS"/*/; do for f in "$d"server_*.log; do [[ -f $f ]] && cp "$f" "$OUT/logs/$(basename "$d").log"; done; done
tar -C "$OUT" -czf "$OUT/server_logs.tgz" logs && rm -rf "$OUT/logs"
if [[ -n "${SMOKE_DRY_RUN:-}" ]]; then exit 0; fi
rm -f "$OUT"/ref_*.log
if [[ -z "$ONE_GPU" ]]; then  # the long form (one-GPU calls print the verdict lines only)
  for f in "$OUT"/*.log; do echo "== $f"; grep -E "^(FAIL|PASSED|FAILED|read_audit|pool_audit|draft_read_audit|draft_write_audit|cached_prefix_ledger|mtp_accept_length|tpot|TTFT|logical|physical|host|hicache activity|log ERROR)" "$f" | cut -c1-400; done
fi
(cd "$RUNS" && tar -czf "$OUT/reports.tgz" --ignore-failed-read */report.json 2>/dev/null)
(cd "$OUT" && tar -czf smoke_logs.tgz --ignore-failed-read -- *.log 2>/dev/null && rm -f -- *.log)
echo "== verdicts (${SMOKE_TP:-2} ranks per server${ONE_GPU:+, all on one GPU}; $(( $(date +%s) - start_s )) s)"
[[ ${#STARTED[@]} -gt 0 ]] && python3 scripts/gpu/smoke_verdicts.py "$RUNS" "${STARTED[@]}" | tee "$OUT/verdicts.txt"
