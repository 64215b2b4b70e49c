#!/usr/bin/env bash
# Sends SIGUSR1 to every sglang scheduler process on this machine: the smoke plugin registered a
# faulthandler on it, so each prints every thread's Python stack into its server's log. For a served
# run that stopped making progress. Kept in a file: a command line that names the processes' title
# would match itself under `pkill -f`.
# Usage: bash scripts/gpu/dump_scheduler_stacks.sh
set -uo pipefail
count=0
for comm in /proc/[0-9]*/cmdline; do
  pid="${comm#/proc/}"; pid="${pid%/cmdline}"
  title="$(tr '\0' ' ' < "$comm" 2>/dev/null)" || continue
  if [[ "$title" == sglang::scheduler* ]]; then
    kill -USR1 "$pid" 2>/dev/null && count=$((count + 1))
  fi
done
echo "dump_scheduler_stacks: signalled $count scheduler processes"
