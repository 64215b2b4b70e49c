#!/usr/bin/env bash
# Builds HERE (CPU machine) what a GPU job needs beyond the GPU machine's Python 3.12 image, as
# parts small enough to travel with one `device` call each (working tree + carry <= 64 MiB):
#
#   .gpu_stage/part-K/   cp312 wheels, the trimmed sglang-kernel tarball, MANIFEST ("part K of N")
#
# What is staged is scripts/gpu/stage_requirements.txt, found by trying imports
# (scripts/gpu/stage_probe.py; `--reprobe` runs it again, ~7 min). Each requirement is downloaded as
# a cp312 manylinux wheel at the version installed here; where that version has no cp312 wheel
# (old releases predate Python 3.12) the newest cp312 release is taken and reported.
# sglang-kernel 0.4.2 is a cp310-abi3 wheel of 1.1 GB; it is packed from this machine's install of
# the same wheel without flash_ops.abi3.so (1 GB, flash attention) and sm100/ (Blackwell).
# Our plugin is not staged: it travels with the repo (PYTHONPATH=python, see remote_env.sh). GPU
# jobs import it directly; none needs the `sglang.srt.plugins` entry point.
#
# `--serve` adds what `sglang serve` needs (docs/gpu.md, "Staging an offline machine"): scripts/gpu/serve_requirements.txt,
# sgl_kernel's flash_ops.abi3.so (FA3; 1 GB as tar.xz -1, split into chunks that
# remote_install.sh reassembles once every chunk has arrived), the deep_gemm package of the
# sglang-kernel wheel, and this plugin built as a wheel (installed there as a user installs it).
#
# `--pd` (implies --serve) adds what the PD smoke needs (docs/gpu.md, "Staging an offline machine"):
# scripts/gpu/pd_requirements.txt (mooncake's transfer engine) and mooncake_syslibs.tar.xz, the system
# libraries its engine.so needs that a CUDA image may lack (Debian 12 builds of libibverbs, libmlx5,
# libnl, libnuma, fetched with apt-get download, and a libcurl.so.4 stand-in compiled from
# scripts/gpu/mooncake_syslibs/libcurl_stub.c); remote_env.sh uses only those the machine lacks.
# These go into parts of their own after the serve parts: parts 1..S hold exactly what --serve alone
# stages (only the N of their MANIFEST differs).
#
# Usage: scripts/gpu/build_stage.sh [--reprobe] [--serve] [--pd]     (PART_LIMIT_MB=60 by default)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/scripts/gpu"
STAGE="$REPO/.gpu_stage"
DOWNLOADS="$STAGE/downloads"
PART_LIMIT_MB="${PART_LIMIT_MB:-60}"
REQUIREMENTS="$HERE/stage_requirements.txt"
KERNEL_DIST="sglang-kernel"
KERNEL_VERSION="0.4.2"
start_s=$(date +%s)

SERVE=0
PD=0
for arg in "$@"; do
  case "$arg" in
    --reprobe)
      python3 "$HERE/stage_probe.py" > "$REQUIREMENTS.new"
      mv "$REQUIREMENTS.new" "$REQUIREMENTS" ;;
    --serve) SERVE=1 ;;
    --pd) SERVE=1; PD=1 ;;
    *) echo "build_stage: unknown argument $arg" >&2; exit 2 ;;
  esac
done
REQUIREMENT_FILES=("$REQUIREMENTS")
if (( SERVE )); then
  REQUIREMENT_FILES+=("$HERE/serve_requirements.txt")
fi
PD_REQUIREMENTS="$HERE/pd_requirements.txt"
if (( PD )); then
  REQUIREMENT_FILES+=("$PD_REQUIREMENTS")
fi

mkdir -p "$DOWNLOADS"
rm -rf "$STAGE"/part-*

platforms=()
for n in $(seq 39 -1 5); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$DOWNLOADS" "$1"
}

# 1. cp312 wheels of the requirements (pip skips files already in DOWNLOADS).
: > "$STAGE/substitutions.txt"
while IFS= read -r req; do
  [[ -z "$req" || "$req" == \#* ]] && continue
  name="${req%%==*}"
  [[ "$name" == "$KERNEL_DIST" ]] && continue
  if ! download "$req" 2>/dev/null; then
    download "$name"
    echo "$req has no cp312 wheel; staged the newest cp312 release of $name" | tee -a "$STAGE/substitutions.txt"
  fi
done < <(cat "${REQUIREMENT_FILES[@]}")

# 2. sglang-kernel, trimmed, from this machine's install (an abi3 wheel: the same files for cp312).
site_packages="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
installed_kernel="$(python3 -c "import importlib.metadata as m; print(m.version('$KERNEL_DIST'))")"
if [[ "$installed_kernel" != "$KERNEL_VERSION" ]]; then
  echo "build_stage: $KERNEL_DIST $installed_kernel installed here, need $KERNEL_VERSION" >&2
  exit 1
fi
kernel_tar="$DOWNLOADS/sgl_kernel-$KERNEL_VERSION-trimmed.tar.xz"
if [[ ! -f "$kernel_tar" ]]; then
  tar -C "$site_packages" -cJf "$kernel_tar" \
    --exclude='sgl_kernel/flash_ops.abi3.so' --exclude='sgl_kernel/sm100' --exclude='__pycache__' \
    sgl_kernel "sglang_kernel-$KERNEL_VERSION.dist-info"
fi

# 2b. For serving: FA3 (chunked), deep_gemm, and the plugin's own wheel.
rm -f "$DOWNLOADS"/*.chunk-* "$DOWNLOADS"/sglang_cp_shared_kv-*.whl
if (( SERVE )); then
  flash_tar="$DOWNLOADS/sgl_kernel-$KERNEL_VERSION-flash_ops.tar.xz"
  if [[ ! -f "$flash_tar" ]]; then
    tar -C "$site_packages" -cf - sgl_kernel/flash_ops.abi3.so | xz -T0 -1 > "$flash_tar.tmp"
    mv "$flash_tar.tmp" "$flash_tar"
  fi
  chunk_mb=$(( PART_LIMIT_MB / 2 ))
  chunks=$(( ($(stat -c %s "$flash_tar") + chunk_mb * 1048576 - 1) / (chunk_mb * 1048576) ))
  split -b "${chunk_mb}M" -d -a 2 "$flash_tar" "$DOWNLOADS/split."
  k=1
  for f in "$DOWNLOADS"/split.*; do
    mv "$f" "$DOWNLOADS/$(basename "$flash_tar").chunk-$k-of-$chunks"
    k=$((k + 1))
  done
  deep_gemm_tar="$DOWNLOADS/deep_gemm-$KERNEL_VERSION.tar.xz"
  [[ -f "$deep_gemm_tar" ]] || tar -C "$site_packages" -cJf "$deep_gemm_tar" --exclude='__pycache__' deep_gemm
  python3 -m pip wheel -q --no-deps -w "$DOWNLOADS" "$REPO"
fi

# 2c. For PD: the system libraries of mooncake's engine.so (NEEDED: libibverbs.so.1, libmlx5.so.1,
#     libnuma.so.1, libcurl.so.4, besides libcudart/libcuda and what its wheel bundles). Debian 12
#     builds (glibc >= 2.34, which the staged sglang wheel needs there anyway) of rdma-core 44
#     (libibverbs with libmlx5, which uses its private symbols, and their libnl) and numactl, as
#     real libraries; libcurl as a stand-in (engine.so calls it only for an http:// metadata server).
syslibs_tar="$DOWNLOADS/pd/mooncake_syslibs.tar.xz"
rm -f "$syslibs_tar"
if (( PD )); then
  debs="$DOWNLOADS/pd/debs"
  mkdir -p "$debs"
  for pkg in libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1; do
    if ! compgen -G "$debs/${pkg}_*_amd64.deb" > /dev/null; then
      (cd "$debs" && apt-get download -q "$pkg:amd64" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
      compgen -G "$debs/${pkg}_*_amd64.deb" > /dev/null || { echo "build_stage: apt-get download $pkg failed" >&2; exit 1; }
    fi
  done
  syslibs_tmp="$(mktemp -d)"
  for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$syslibs_tmp/root"; done
  mkdir "$syslibs_tmp/mooncake_syslibs"
  for lib in libibverbs.so.1 libmlx5.so.1 libnl-3.so.200 libnl-route-3.so.200 libnuma.so.1; do
    found="$(find "$syslibs_tmp/root" -name "$lib" | head -1)"
    [[ -n "$found" ]] || { echo "build_stage: $lib is in none of $debs/*.deb" >&2; exit 1; }
    cp -L "$found" "$syslibs_tmp/mooncake_syslibs/$lib"
  done
  gcc -shared -fPIC -O2 -Wall -Wl,-soname,libcurl.so.4 -o "$syslibs_tmp/mooncake_syslibs/libcurl.so.4" \
    "$HERE/mooncake_syslibs/libcurl_stub.c"
  (cd "$debs" && ls *.deb) > "$syslibs_tmp/mooncake_syslibs/SOURCES"
  echo "libcurl.so.4 <- scripts/gpu/mooncake_syslibs/libcurl_stub.c" >> "$syslibs_tmp/mooncake_syslibs/SOURCES"
  tar -C "$syslibs_tmp" -cJf "$syslibs_tar" mooncake_syslibs
  rm -rf "$syslibs_tmp"
fi

# 3. Keep only what the requirement list names (older downloads of other versions are dropped), then
#    split into parts of at most PART_LIMIT_MB, largest first (first fit).
python3 - "$DOWNLOADS" "$STAGE" "$PART_LIMIT_MB" "$KERNEL_DIST" "$SERVE" "$PD" "$PD_REQUIREMENTS" "$syslibs_tar" \
  "${REQUIREMENT_FILES[@]}" <<'EOF'
import pathlib, re, shutil, sys

downloads, stage, limit_mb, kernel_dist, serve, pd, pd_requirements, syslibs_tar, *requirement_files = sys.argv[1:]
limit = int(limit_mb) * 1024 * 1024
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
names = lambda path: {norm(l.split("==")[0].strip()) for l in open(path) if l.strip() and not l.startswith("#")}
wanted = set().union(*(names(path) for path in requirement_files))
wanted.discard(norm(kernel_dist))
if serve == "1":
    wanted.add("sglang_cp_shared_kv")
pd_names = names(pd_requirements) if pd == "1" else set()
by_name = {}
for f in sorted(pathlib.Path(downloads).iterdir()):
    if f.suffix == ".whl":
        by_name.setdefault(norm(f.name.split("-")[0]), []).append(f)
missing = wanted - set(by_name)
if missing:
    sys.exit(f"build_stage: no wheel downloaded for {sorted(missing)}")
newest = lambda n: max(by_name[n], key=lambda f: f.stat().st_mtime)
files = [newest(n) for n in sorted(wanted - pd_names)]
files += [f for f in pathlib.Path(downloads).glob("*.tar.xz") if "-trimmed" in f.name or (serve == "1" and "flash_ops" not in f.name)]
files += list(pathlib.Path(downloads).glob("*.chunk-*"))
pd_files = [newest(n) for n in sorted(pd_names)] + ([pathlib.Path(syslibs_tar)] if pd == "1" else [])


def pack(files):
    """First fit, largest first, into parts of at most `limit` bytes."""
    parts = []
    for f in sorted(files, key=lambda f: f.stat().st_size, reverse=True):
        size = f.stat().st_size
        if size > limit:
            sys.exit(f"build_stage: {f.name} ({size >> 20} MiB) is over the part limit")
        for part in parts:
            if part["bytes"] + size <= limit:
                break
        else:
            part = {"bytes": 0, "files": []}
            parts.append(part)
        part["bytes"] += size
        part["files"].append(f)
    return parts


# The PD files get parts of their own, after the others: those stay what they are without --pd.
parts = pack(files) + pack(pd_files)
for k, part in enumerate(parts, start=1):
    d = pathlib.Path(stage) / f"part-{k}"
    d.mkdir()
    for f in part["files"]:
        shutil.copy2(f, d / f.name)
    names = "\n".join(sorted(f.name for f in part["files"]))
    (d / "MANIFEST").write_text(f"part {k} of {len(parts)}\n{names}\n")
    print(f"part-{k}: {len(part['files'])} files, {part['bytes'] / 2**20:.1f} MiB")
EOF

tree_bytes=$(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "working tree that travels with every call: $((tree_bytes / 1024)) KiB (+ one part <= ${PART_LIMIT_MB} MiB)"
echo "staging built in $(( $(date +%s) - start_s )) s"
