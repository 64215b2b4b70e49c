#!/usr/bin/env bash
# Runs THERE (GPU machine): installs one staged part (a folder built by build_stage.sh and carried
# with the call) into $GPU_STAGE_SITE (default /tmp/site).
#
# Part 1 starts a fresh target (a fresh machine has none; a warm one is restaged from scratch).
# Later parts are added to it: each part is installed into its own scratch target, then merged in
# with `cp -a`. That is `pip install --upgrade --target` without its flaw: pip --upgrade replaces a
# whole top-level folder that already exists, which would drop namespace packages (and bin/) that
# two parts share.
#
# Chunks of a large tarball (NAME.tar.xz.chunk-K-of-N, see build_stage.sh --serve) can arrive in
# different parts: they wait in $site.chunks/ and are unpacked once all N are there.
#
# Usage: bash scripts/gpu/remote_install.sh .gpu_stage/part-K
set -euo pipefail
part="${1:?usage: remote_install.sh .gpu_stage/part-K}"
site="${GPU_STAGE_SITE:-/tmp/site}"
manifest_line="$(head -1 "$part/MANIFEST")"            # "part K of N"
start_s=$(date +%s)

if [[ "$manifest_line" == "part 1 of "* ]]; then
  rm -rf "$site" "$site.chunks"
elif ! grep -q "^part 1 of " "$site/.staged_parts" 2>/dev/null; then
  # A machine given back and started afresh between two calls has lost the earlier parts.
  echo "remote_install: $manifest_line, but part 1 is not staged in $site (a fresh machine?): stage from part 1" >&2
  exit 3
fi
mkdir -p "$site" "$site.chunks"
scratch="$(mktemp -d /tmp/stage-part.XXXXXX)"
shopt -s nullglob
wheels=("$part"/*.whl)
if (( ${#wheels[@]} )); then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$scratch" "${wheels[@]}"
fi
for tarball in "$part"/*.tar.xz; do
  tar -C "$scratch" -xJf "$tarball"
done
for chunk in "$part"/*.chunk-*-of-*; do
  cp "$chunk" "$site.chunks"/
done
for first in "$site.chunks"/*.chunk-1-of-*; do
  base="${first%.chunk-1-of-*}"
  total="${first##*-of-}"
  have=$(ls "$base".chunk-*-of-"$total" | wc -l)
  if [[ "$have" == "$total" ]]; then
    for k in $(seq 1 "$total"); do cat "$base.chunk-$k-of-$total"; done | tar -C "$scratch" -xJf -
    rm -f "$base".chunk-*-of-"$total"
    echo "remote_install: unpacked $(basename "$base") from $total chunks"
  fi
done
cp -a "$scratch"/. "$site"/
rm -rf "$scratch"
echo "$manifest_line" >> "$site/.staged_parts"
echo "remote_install: $manifest_line -> $site (${#wheels[@]} wheels) in $(( $(date +%s) - start_s )) s"
