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
# PD parts (build_stage.sh --pd) bring mooncake_syslibs/: system libraries mooncake's engine.so needs.
# Only those the machine lacks go on LD_LIBRARY_PATH (through links in mooncake_syslibs/active/):
# libibverbs and libmlx5 as a pair (libmlx5 uses libibverbs' private symbols of its own version),
# with their libnl; libnuma; libcurl (a stand-in, see scripts/gpu/mooncake_syslibs/libcurl_stub.c).
if [[ -d "$_stage_site/mooncake_syslibs" ]]; then
  _stage_libs="$_stage_site/mooncake_syslibs"
  _stage_cache="$( (/sbin/ldconfig -p || ldconfig -p) 2>/dev/null)"
  _stage_lacks() { [[ "$_stage_cache" != *$'\t'"$1 (libc6,x86-64)"* ]]; }
  rm -rf "$_stage_libs/active"
  mkdir -p "$_stage_libs/active"
  _stage_use=()
  if _stage_lacks libibverbs.so.1 || _stage_lacks libmlx5.so.1; then
    _stage_use+=(libibverbs.so.1 libmlx5.so.1 libnl-3.so.200 libnl-route-3.so.200)
  fi
  _stage_lacks libnuma.so.1 && _stage_use+=(libnuma.so.1)
  _stage_lacks libcurl.so.4 && _stage_use+=(libcurl.so.4)
  for _stage_lib in "${_stage_use[@]}"; do ln -s "../$_stage_lib" "$_stage_libs/active/$_stage_lib"; done
  if (( ${#_stage_use[@]} )); then
    export LD_LIBRARY_PATH="$_stage_libs/active${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "remote_env: staged for mooncake (the machine lacks them): ${_stage_use[*]}" >&2
  fi
  unset -f _stage_lacks
  unset _stage_libs _stage_cache _stage_use _stage_lib
fi
unset _stage_site _stage_repo _stage_expected _stage_have
