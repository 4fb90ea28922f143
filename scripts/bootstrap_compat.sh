#!/usr/bin/env bash
# Creates .venv-compat: the older kernels + transformers pair a user may still
# pin (requirements-compat.lock), over .venv's heavy packages. Its own
# site-packages holds only the pinned set; a .pth file appends .venv's
# site-packages after it, so torch, jax, libtpu and torch-tpu are shared and
# the pinned kernels / transformers win. Idempotent: a second run only checks
# the stamp (both lock files: the overlay is checked against .venv's set).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
main="$root/.venv"
venv="$root/.venv-compat"
stamp="$venv/.requirements-compat.lock.sha256"
want="$(cat "$root/requirements.lock" "$root/requirements-compat.lock" | sha256sum | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
rm -rf "$venv"
# The same interpreter as .venv, so its compiled packages load here too.
"$main/bin/python" -m venv --without-pip "$venv"
site() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
# .venv's pip installs into the new venv's site-packages (no pip of its own needed).
"$main/bin/python" -m pip install --quiet --no-deps --no-compile --target "$(site "$venv/bin/python")" \
  -r "$root/requirements-compat.lock"
# site.addsitedir also runs .venv's own .pth files; entries go after ours.
echo "import site; site.addsitedir('$(site "$main/bin/python")')" > "$(site "$venv/bin/python")/zz_main_venv.pth"
"$main/bin/python" -m pip --python "$venv/bin/python" check
echo "$want" > "$stamp"
