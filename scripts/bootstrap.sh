#!/usr/bin/env bash
# Creates .venv with the pinned dependency set (requirements.lock) if it is
# missing or out of date. Idempotent: a second run only checks the stamp.
# `bootstrap.sh bench` adds the benchmark-only peers (bench/requirements.lock)
# and, without their dependencies, bench/requirements-nodeps.lock (peers whose
# serving stack the benchmarks do not import).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.requirements.lock.sha256"
locks=("$root/requirements.lock")
nodeps=()
if [[ "${1:-}" == "bench" ]]; then
  locks+=("$root/bench/requirements.lock")
  nodeps+=("$root/bench/requirements-nodeps.lock")
fi
want="$(cat "${locks[@]}" "${nodeps[@]}" | sha256sum | cut -d' ' -f1)"
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
for lock in "${nodeps[@]}"; do
  "$venv/bin/python" -m pip install --quiet --no-deps -r "$lock"
done
# pip check, except the requirements of the packages installed without their
# dependencies (unmet on purpose; also when a plain bootstrap runs on a venv
# that has them): every other conflict still fails.
skip="$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' "$root/bench/requirements-nodeps.lock" | tr 'A-Z_' 'a-z-')"
conflicts="$("$venv/bin/python" -m pip check || true)"
if [[ -n "$skip" ]]; then
  conflicts="$(grep -viE "^($(echo "$skip" | paste -sd'|')) " <<<"$conflicts" || true)"
fi
if [[ -n "$conflicts" && "$conflicts" != "No broken requirements found." ]]; then
  echo "$conflicts" >&2
  exit 1
fi
echo "$want" > "$stamp"
