#!/usr/bin/env bash
# Create .venv-int (if needed): guestd plus the agent frameworks of guestd.integrations,
# pinned in scripts/integrations-requirements.txt. Rebuilt only when that file or
# pyproject.toml changes (a hash of both is the stamp). Exit 0: ready; exit 3: could not
# be built (e.g. PyPI unreachable): the integration tests skip, with the reason printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${GUESTD_INT_VENV:-.venv-int}"
want=$(cat scripts/integrations-requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
stamp="$VENV/.guestd-int-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV" || { echo "python3 -m venv failed" >&2; exit 3; }
log="$VENV/install.log"
echo "installing the integration venv $VENV (log: $log)" >&2
if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -e . -r scripts/integrations-requirements.txt >"$log" 2>&1; then
  tail -n 5 "$log" >&2
  echo "could not install the agent frameworks (PyPI unreachable?); full log in $log" >&2
  exit 3
fi
echo "$want" >"$stamp"
