#!/usr/bin/env bash
# Creates .venv with the pinned dependency set (requirements.lock) if it is
# missing or out of date. Idempotent: a second run only checks the stamp.
# `bootstrap.sh bench` adds the benchmark-only peers (bench/requirements.lock).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.requirements.lock.sha256"
locks=("$root/requirements.lock")
if [[ "${1:-}" == "bench" ]]; then
  locks+=("$root/bench/requirements.lock")
fi
want="$(cat "${locks[@]}" | sha256sum | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
# torch is pinned to 2.13.0 (the CPU build on disk); asking for it by exact
# version keeps pip from resolving a multi-GB CUDA build.
for lock in "${locks[@]}"; do
  "$venv/bin/python" -m pip install --quiet -r "$lock"
done
"$venv/bin/python" -m pip check
echo "$want" > "$stamp"
