#!/usr/bin/env bash
# Creates .venv with the pinned dependency set (requirements.lock) if it is
# missing or out of date. Idempotent: a second run only checks the stamp.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.requirements.lock.sha256"
want="$(sha256sum "$root/requirements.lock" | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
# torch is pinned to 2.13.0 (the CPU build on disk); asking for it by exact
# version keeps pip from resolving a multi-GB CUDA build.
"$venv/bin/python" -m pip install --quiet -r "$root/requirements.lock"
"$venv/bin/python" -m pip check
echo "$want" > "$stamp"
