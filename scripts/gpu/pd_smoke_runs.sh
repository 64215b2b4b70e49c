#!/usr/bin/env bash
# Runs on a machine with two GPUs and the project installed with mooncake (docs/gpu.md, "PD pair
# smoke"), or staged with `build_stage.sh --pd` (docs/gpu.md, "Staging an offline machine"): the PD smoke with the tiny GLM-5 (dummy weights), mooncake over TCP on this host.
#
#   1. what the machine has: the system libraries mooncake's engine.so needs (and which staged ones
#      remote_env.sh put on LD_LIBRARY_PATH), RDMA devices, the mooncake version;
#   2. scripts/gpu/mooncake_tcp_probe.py: two transfer engines set up as sglang sets them up write host
#      and GPU buffers to each other over TCP (~10-20 s). If it fails, nothing else runs;
#   3. scripts/glm5_pd_smoke.py --audit --shared-kv both: the prefill server (--tp 2, GPUs 0,1,
#      HiCache) with a stock decode server (--tp 1, GPU 1, CUDA graphs), shared KV off, then on; both
#      servers with --grammar-backend none (xgrammar is not staged). The KV audits judge (transfer
#      audit: decode bytes == prefill bytes; shared-KV prefill vs stock prefill; read audit), and the
#      value audit (the shared-KV pair's prefill and decode within the tolerance the stock pair's
#      prefill and decode set; the verdict lines show both sides' rows, max and tolerance).
#      Mode `plant` instead runs one shared-KV pair with the planted page-pairing bug
#      (pd-send-wrong-page): its transfer audit must FAIL.
#      Mode `mtp` runs both pairs with MTP on both servers (--mtp: EAGLE with the NextN layer, 3/1/4,
#      and the shared-KV opt-in) on the tiny GLM-5 with its NextN layer (make_tiny_glm5_config.py
#      --nextn): the transfer audit then covers the draft pool's rows byte for byte (the stock decode
#      server receives a complete draft pool), the shared-KV prefill's draft write / read audits and
#      cached-prefix ledger judge, accept lengths are reported. Mode `mtp-plant` runs one shared-KV
#      MTP pair with PD_PLANT (default draft-wrong-owner; or draft-stale-load-back): it must FAIL.
#
# The whole run stays inside PD_BUDGET_S (default 530 s, so that installing the last part fits in the
# same 600 s call): the smoke gets what the probe left, minus a minute to stop servers and pack logs;
# at that limit it is sent SIGTERM, which stops its servers. sglang's PD timeouts are cut from 300 s to
# 120 s, so a KV transfer that never arrives fails its request instead of holding the call.
#
# Results under $OUT (at most 8 files come back): probe.log, probe.json, pd_smoke.log, report.json,
# pd_logs.tgz (both servers' logs of both pairs, the probe's engine logs).
#
# Usage: bash scripts/gpu/pd_smoke_runs.sh [probe|all|plant|mtp|mtp-plant|dry-run|mtp-dry-run] [more glm5_pd_smoke.py arguments]
#   dry-run: the smoke prints both pairs' commands, environments (GPUs) and plan, launches nothing;
#            no machine check, no probe (no GPU needed, remote_env.sh not sourced). mtp-dry-run: the
#            same for the mtp mode's pairs.
#
# Environment (all optional):
#   PD_TP=2|4|8         prefill --tp (= CP size), on GPUs 0..PD_TP-1
#   PD_MODEL=tiny|glm5-width   the tiny GLM-5 (default), or GLM-5's widths with as many layers as the
#                       prefill's share of PD_TP H200s holds (make_tiny_glm5_config.py --glm5-width,
#                       sized at --mem-fraction-static 0.4; PD_WEIGHTS bf16|fp8, default fp8); its KV
#                       audits (transfer audit included) cover the first PD_AUDIT_LAYERS layers (default 2); so
#                       do the tiny model's in the one-GPU mode (every layer with several GPUs)
#   PD_DECODE_GPUS, PD_DECODE_TP   the stock decode server. Default, tiny: --tp 1 on the prefill's last
#                       GPU; glm5-width: --tp PD_TP on the prefill's GPUs. Sharing a GPU, the prefill takes
#                       --mem-fraction-static 0.35 (glm5-width 0.4) of it and the decode, launched second,
#                       0.75 (0.85): sglang counts the fraction of the whole GPU, less what is in use, so
#                       the decode gets the difference. On 8 GPUs with PD_TP=4, PD_DECODE_GPUS=4,5,6,7
#                       gives the decode GPUs of its own.
#   SMOKE_ONE_GPU=1     test-only (docs/gpu.md, "One-GPU test mode"): every prefill rank and the decode
#                       server on device 0 (the smoke plugin's one-GPU hook, glm5_pd_smoke.py --one-gpu),
#                       PD_TP 2, 4 or 8; the KV still crosses mooncake over TCP on loopback. Tiny model only.
set -uo pipefail
start_s=$(date +%s)
mode="${1:-all}"
skip=""; [[ "$mode" == *dry-run ]] && skip=1
mtp=(); [[ "$mode" == mtp* ]] && mtp=(--mtp)
SKIP_STAGED_ENV="$skip" source scripts/gpu/runner_env.sh || exit 1
OUT="${OUT:-/tmp/pd_out}"
RUNS=/tmp/pd_runs
TP="${PD_TP:-2}"
ONE_GPU="${SMOKE_ONE_GPU:-}"
[[ -z "$ONE_GPU" || "$ONE_GPU" == 1 ]] || { echo "SMOKE_ONE_GPU must be 1 or unset" >&2; exit 2; }
PREFILL_GPUS="$(seq -s, 0 $(( TP - 1 )))"
[[ -n "$ONE_GPU" ]] && PREFILL_GPUS=0
case "${PD_MODEL:-tiny}" in
  tiny)
    MODEL="${PD_MODEL_DIR:-/tmp/tiny-glm5}"
    [[ ${#mtp[@]} -gt 0 ]] && MODEL="${PD_NEXTN_MODEL_DIR:-/tmp/tiny-glm5-nextn}"
    DECODE_GPUS="${PD_DECODE_GPUS:-$(( TP - 1 ))}"; DECODE_TP="${PD_DECODE_TP:-1}"
    # one GPU: the read audit's per-forward pool all-gathers go over sockets; two layers (docs/gpu.md)
    [[ -n "$ONE_GPU" ]] && { DECODE_GPUS=0; DECODE_TP=1; export SGLANG_CP_SHARED_KV_SMOKE_AUDIT_LAYERS="${PD_AUDIT_LAYERS:-2}"; }
    MEM=(--prefill-mem-fraction-static 0.35 --decode-mem-fraction-static 0.75)
    make_model=(--no-check)
    [[ ${#mtp[@]} -gt 0 ]] && make_model=(--nextn --no-check) ;;
  glm5-width)
    [[ ${#mtp[@]} -gt 0 ]] && { echo "the mtp modes run the tiny model (PD_MODEL=tiny)" >&2; exit 2; }
    [[ -n "$ONE_GPU" ]] && { echo "SMOKE_ONE_GPU runs the tiny model (PD_MODEL=tiny)" >&2; exit 2; }
    MODEL="${PD_MODEL_DIR:-/tmp/glm5-width-pd-tp$TP}"
    export SGLANG_CP_SHARED_KV_SMOKE_AUDIT_LAYERS="${PD_AUDIT_LAYERS:-2}"
    DECODE_GPUS="${PD_DECODE_GPUS:-$PREFILL_GPUS}"; DECODE_TP="${PD_DECODE_TP:-$TP}"
    MEM=(--prefill-mem-fraction-static 0.4 --decode-mem-fraction-static 0.85)
    make_model=(--glm5-width --tp "$TP" --weights "${PD_WEIGHTS:-fp8}" --mem-fraction-static 0.4
                --physical-tokens-per-rank 65536 --no-check) ;;
  *) echo "PD_MODEL must be tiny or glm5-width" >&2; exit 2 ;;
esac
BUDGET_S="${PD_BUDGET_S:-530}"  # e.g. PD_BUDGET_S=330 for mode plant (one pair)
shift || true
one_gpu=(); [[ -n "$ONE_GPU" ]] && one_gpu=(--one-gpu)
rm -rf "$RUNS"
mkdir -p "$OUT" "$RUNS/smoke" "$RUNS/probe"
left() { echo $(( BUDGET_S - ($(date +%s) - start_s) )); }
pack_logs() {
  # Not the audit dumps (hundreds of MB: packing them outlasted a call): their verdicts are in report.json.
  tar -C "$RUNS" --exclude='audit_*/pool' -czf "$OUT/pd_logs.tgz" smoke probe 2>/dev/null
  [[ -f "$RUNS/smoke/report.json" ]] && cp "$RUNS/smoke/report.json" "$OUT/report.json"
}

if [[ "$mode" == *dry-run ]]; then
  [[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" "${make_model[@]}" > /dev/null
  python3 scripts/glm5_pd_smoke.py --model-path "$MODEL" --load-format dummy --audit --shared-kv both \
    --prefill-tp "$TP" --prefill-gpus "$PREFILL_GPUS" --decode-tp "$DECODE_TP" --decode-gpu "$DECODE_GPUS" \
    "${MEM[@]}" --out-dir "$RUNS/smoke" --extra-prefill-args "--grammar-backend none" \
    --extra-decode-args "--grammar-backend none --cuda-graph-max-bs 8" --dry-run "${mtp[@]}" "${one_gpu[@]}" "$@"
  exit $?
fi
{
  echo "== machine"
  cache="$( (/sbin/ldconfig -p || ldconfig -p) 2>/dev/null)"
  for lib in libibverbs.so.1 libmlx5.so.1 libnl-3.so.200 libnuma.so.1 libcurl.so.4 libcuda.so.1 libcudart.so.13; do
    hit="$(grep -m1 -F $'\t'"$lib (libc6,x86-64)" <<< "$cache" | sed 's/.*=> //')"
    echo "system $lib: ${hit:-MISSING}"
  done
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  ls /dev/infiniband 2>&1 | head -3
  ls /sys/class/infiniband 2>&1 | head -3
  python3 -c "import importlib.metadata as m; print('mooncake-transfer-engine-cuda13', m.version('mooncake-transfer-engine-cuda13'))"
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader
  echo "== probe"
} > "$OUT/probe.log" 2>&1
timeout -k 10 120 python3 scripts/gpu/mooncake_tcp_probe.py --json "$OUT/probe.json" --log-dir "$RUNS/probe" >> "$OUT/probe.log" 2>&1
probe_rc=$?
echo "probe: exit $probe_rc ($(( $(date +%s) - start_s )) s)"
grep -E "^(mooncake_tcp_probe|FAIL|system|remote_env)" "$OUT/probe.log"
if (( probe_rc != 0 )) || [[ "$mode" == probe ]]; then
  (( probe_rc != 0 )) && tail -40 "$OUT/probe.log"
  pack_logs
  exit "$probe_rc"
fi

[[ -f $MODEL/config.json ]] || python3 scripts/make_tiny_glm5_config.py "$MODEL" "${make_model[@]}" > /dev/null
smoke_s=$(( $(left) - 60 ))
echo "pd smoke: $smoke_s s left for it"
if [[ "$mode" == plant ]]; then
  pairs=(--shared-kv on --plant pd-send-wrong-page)
elif [[ "$mode" == mtp-plant ]]; then
  pairs=(--shared-kv on --plant "${PD_PLANT:-draft-wrong-owner}")
else
  pairs=(--shared-kv both)
fi
timeout -s TERM -k 75 "$smoke_s" python3 scripts/glm5_pd_smoke.py --model-path "$MODEL" --load-format dummy \
  --audit "${pairs[@]}" "${mtp[@]}" "${one_gpu[@]}" --out-dir "$RUNS/smoke" --startup-timeout 300 --request-timeout 150 \
  --prefill-tp "$TP" --prefill-gpus "$PREFILL_GPUS" --decode-tp "$DECODE_TP" --decode-gpu "$DECODE_GPUS" "${MEM[@]}" \
  --extra-prefill-args "--grammar-backend none" \
  --extra-decode-args "--grammar-backend none --cuda-graph-max-bs 8" \
  --ignore-log-pattern "Can not initialize OpenAIServingResponses" "$@" > "$OUT/pd_smoke.log" 2>&1
smoke_rc=$?
echo "pd smoke: exit $smoke_rc ($(( $(date +%s) - start_s )) s in all)"
pack_logs
grep -E "^(\[pd-shared-kv-(on|off)\] (prefill|decode):|== |prefill logical|prefill physical|hicache activity|latency|  prefix|transfer_audit|read_audit|pool_audit|(prefill|decode) values|draft_read_audit|draft_write_audit|cached_prefix_ledger|mtp_accept_length|prefill log ERROR|decode log|FAIL|PASSED|FAILED|terminated)" \
  "$OUT/pd_smoke.log" | cut -c1-400
if [[ -f "$OUT/report.json" ]]; then
  python3 - "$OUT/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for run in r["runs"]:
    f = run["figures"]
    values = "".join(f"; {side} {f[f'values_{side}']}" for side in ("prefill", "decode") if f.get(f"values_{side}"))
    print(f"verdict {run['mode']}: {len(run['failures'])} failures{values}")
print(f"greedy differences off vs on (reported, not judged): {len(r.get('greedy_differences', []))}")
PY
fi
exit "$smoke_rc"
