#!/usr/bin/env bash
# Runs on a machine with two GPUs and the project installed (README), or staged (docs/gpu.md,
# "Staging an offline machine"): the end-to-end smoke of `sglang serve` at --tp 2 with the tiny
# GLM-5 (dummy weights). docs/gpu.md, "Serve smoke", says what each mode prints and what passes.
#
#   correctness   reference servers (shared KV off) and shared-KV servers, all at once (each server
#                 spans both GPUs; pools are capped by --max-total-tokens), with the KV audits on:
#                 bf16 write_through + chunked prefill + a burst of 12; bf16 write_back; bf16 radix
#                 cache only (against a radix-only reference); fp8 write_through; bf16 without the
#                 overlap scheduler. Each shared-KV run compares its pool dumps with its
#                 reference's and checks its read audit.
#   plants        shared-KV bf16 runs with a planted bug; each must FAIL (the oracle catches it).
#   perf          shared KV off, then on, alone on the machine, audits off: TTFT of 16K-token prefixes
#                 from host vs recomputed, TPOT at 4K / 16K / 64K tokens of context.
#
#   confirm       the bf16 write_through/chunked/burst and fp8 runs with their references only.
#
# Usage: bash scripts/gpu/serve_smoke_runs.sh correctness|confirm|plants|perf   (results under $OUT)
set -uo pipefail
# A staged machine (remote_install.sh) needs the staged packages first on the path; an installed one does not.
if [[ -f "${GPU_STAGE_SITE:-/tmp/site}/.staged_parts" ]]; then source scripts/gpu/remote_env.sh || exit 1; fi
export SGLANG_JIT_DEEPGEMM_PRECOMPILE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH="/tmp/site/bin:$PATH"
OUT="${OUT:-/tmp/smoke_out}"
RUNS=/tmp/smoke_runs
MODEL=/tmp/tiny-glm5
mkdir -p "$OUT" "$RUNS"
[[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" --no-check >/dev/null
smoke() {  # smoke NAME ARGS...: one smoke process, log under $OUT
  local name=$1; shift
  python3 scripts/glm5_cp_hicache_smoke.py --model-path "$MODEL" --tp 2 --load-format dummy \
    --mem-fraction-static 0.85 --startup-timeout 500 --out-dir "$RUNS/$name" \
    --ignore-log-pattern "Can not initialize OpenAIServingResponses" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
}
GRAMMAR="--grammar-backend none"
case "${1:?correctness|confirm|plants|perf}" in
  correctness)
    smoke ref_bf16 --shared-kv off --audit --burst 12 \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048" &
    smoke on_bf16_wt_chunked --shared-kv on --audit --burst 12 --reference-dir "$RUNS/ref_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048" &
    smoke on_bf16_wb --shared-kv on --audit --reference-dir "$RUNS/ref_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_back" &
    smoke ref_bf16_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR" &
    smoke on_bf16_radix --shared-kv on --no-hicache --audit --reference-dir "$RUNS/ref_bf16_radix" \
      --extra-server-args "$GRAMMAR" &
    # fp8 against a stock reference that never loads back: stock 0.5.11's NSA host pool corrupts
    # fp8 KV on load-back (docs/cp-hicache.md), which a HiCache reference would count against us.
    smoke ref_fp8_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3" &
    smoke on_fp8 --shared-kv on --audit --reference-dir "$RUNS/ref_fp8_radix" \
      --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3 --hicache-write-policy write_through" &
    smoke on_bf16_no_overlap --shared-kv on --audit --reference-dir "$RUNS/ref_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --disable-overlap-schedule" &
    wait ;;
  confirm)  # the bf16 and fp8 shared-KV runs and their references, in one short call
    smoke ref_bf16 --shared-kv off --audit --burst 12 \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048" &
    smoke on_bf16_wt_chunked --shared-kv on --audit --burst 12 --reference-dir "$RUNS/ref_bf16" \
      --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048" &
    smoke ref_fp8_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3" &
    smoke on_fp8 --shared-kv on --audit --reference-dir "$RUNS/ref_fp8_radix" \
      --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3 --hicache-write-policy write_through" &
    wait ;;
  plants)
    # fp8: stock 0.5.11's NSA host pool corrupts fp8 KV on load-back (docs/cp-hicache.md), so the fp8
    # shared-KV run is also judged against a stock reference that never loads back (radix only).
    smoke ref_fp8_radix --shared-kv off --no-hicache --audit --extra-server-args "$GRAMMAR --kv-cache-dtype fp8_e4m3" &
    for bug in read-wrong-owner load-back-wrong-page; do
      smoke "plant_$bug" --shared-kv on --audit --plant "$bug" --reference-dir "$RUNS/ref_bf16" \
        --extra-server-args "$GRAMMAR --hicache-write-policy write_through --chunked-prefill-size 2048" &
    done
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
  perf)
    for mode in off on; do
      smoke "perf_$mode" --shared-kv $mode --physical-tokens-per-rank 81920 --max-prefix-tokens 32768 \
        --tpot-contexts 4096,16384,65536 --max-new-tokens 8 --extra-server-args "$GRAMMAR --hicache-write-policy write_through"
    done ;;
esac
mkdir -p "$OUT/logs"
for d in "$RUNS"/*/; do for f in "$d"server_*.log; do [[ -f $f ]] && cp "$f" "$OUT/logs/$(basename "$d").log"; done; done
tar -C "$OUT" -czf "$OUT/server_logs.tgz" logs && rm -rf "$OUT/logs"
rm -f "$OUT"/ref_*.log
for f in "$OUT"/*.log; do echo "== $f"; grep -E "^(FAIL|PASSED|FAILED|read_audit|pool_audit|tpot|TTFT|logical|physical|host|hicache activity|log ERROR)" "$f" | cut -c1-400; done
