#!/usr/bin/env bash
# Create .venv (if needed) and install guestd with its dev tools into it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "guestd needs Python >= 3.11 (found: $("$PY" --version 2>&1 || echo none))" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv || { echo "python3 -m venv failed; on Debian: apt-get install -y python3-venv" >&2; exit 1; }
fi
stamp=.venv/.guestd-installed
newer=""
for f in pyproject.toml setup.py guestd/children/_clone.c; do  # the native spawn is built at install
  [ -f "$stamp" ] && [ "$f" -nt "$stamp" ] && newer=1
done
if [ ! -f "$stamp" ] || [ -n "$newer" ]; then
  log=.venv/install.log
  echo "installing guestd and its dependencies into .venv (log: $log)" >&2
  if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e '.[dev]'; } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "pip install failed; full log in $log" >&2
    exit 1
  fi
  touch "$stamp"
fi
