# Source THERE (GPU machine) after remote_install.sh has installed every part:
#   source scripts/gpu/remote_env.sh
# Puts our plugin (from the repo that travelled) and the staged packages ahead of the image's own
# (the image's transformers 5.17 must not win). Returns non-zero if a part is missing, e.g. because
# the machine went cold between the install calls and a fresh one got only the later parts.
_stage_site="${GPU_STAGE_SITE:-/tmp/site}"
_stage_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ ! -f "$_stage_site/.staged_parts" ]]; then
  echo "remote_env: nothing staged in $_stage_site; run remote_install.sh for every part" >&2
  return 1
fi
_stage_expected="$(head -1 "$_stage_site/.staged_parts" | awk '{print $4}')"
_stage_have="$(sort -u "$_stage_site/.staged_parts" | wc -l)"
if [[ "$_stage_have" != "$_stage_expected" ]]; then
  echo "remote_env: $_stage_have of $_stage_expected parts staged in $_stage_site" >&2
  return 1
fi
export PYTHONPATH="$_stage_repo/python:$_stage_site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The JIT HiCache kernel (tvm-ffi) compiles with nvcc at first use.
if [[ -z "${CUDA_HOME:-}" && -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDA_HOME=/usr/local/cuda
fi
unset _stage_site _stage_repo _stage_expected _stage_have
