# Sourced by the GPU runners (serve_smoke_runs.sh, pd_smoke_runs.sh, bench_serving_runs.sh): the
# environment every server they start needs. Set SKIP_STAGED_ENV=1 for a dry run.
# A staged machine (remote_install.sh) needs the staged packages first on the path; an installed one does not.
if [[ -z "${SKIP_STAGED_ENV:-}" && -f "${GPU_STAGE_SITE:-/tmp/site}/.staged_parts" ]]; then
  source scripts/gpu/remote_env.sh || return 1
fi
# DeepGEMM would precompile thousands of kernels before /health answers; NVLink multicast stays off.
export SGLANG_JIT_DEEPGEMM_PRECOMPILE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="${SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT:-120}"
export SGLANG_DISAGGREGATION_WAITING_TIMEOUT="${SGLANG_DISAGGREGATION_WAITING_TIMEOUT:-120}"
export PATH="${GPU_STAGE_SITE:-/tmp/site}/bin:$PATH"
# One-GPU test mode (docs/gpu.md): the smokes also set these on every server; exported here so that
# anything else the runner starts (the mooncake probe) sees the same.
if [[ "${SMOKE_ONE_GPU:-}" == 1 ]]; then
  export NCCL_SOCKET_IFNAME=lo SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0
fi
