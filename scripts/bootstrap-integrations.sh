#!/usr/bin/env bash
# Create an integration venv (if needed): guestd plus the agent frameworks of
# guestd.integrations, pinned in a requirements file. Two sets:
#   (no argument)  .venv-int  scripts/integrations-requirements.txt  SWE-ReX, mini-swe-agent
#   openhands      .venv-oh   scripts/openhands-requirements.txt     OpenHands SDK (Python >= 3.12)
# Rebuilt only when the requirements file or pyproject.toml changes (a hash of both and the
# interpreter's version is the stamp). Exit 0: ready; exit 3: could not be built (no suitable
# interpreter, PyPI unreachable): the integration tests skip, with the reason printed.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "")
    PY="${PYTHON:-python3}"
    VENV="${GUESTD_INT_VENV:-.venv-int}"
    REQS=scripts/integrations-requirements.txt
    ;;
  openhands)
    # openhands-sdk needs Python >= 3.12: $PYTHON312, else the first python3.12/3.13 found
    # (on PATH or under pyenv).
    PY="${PYTHON312:-}"
    if [ -z "$PY" ]; then
      for c in python3.12 python3.13 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$HOME"/.pyenv/versions/3.13*/bin/python3.13; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys, venv; assert sys.version_info >= (3, 12)' 2>/dev/null; then
          PY="$c"
          break
        fi
      done
    fi
    if [ -z "$PY" ] || ! "$PY" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
      echo "no Python >= 3.12 interpreter found${PY:+ ($PY is not one)} (openhands-sdk needs one; set PYTHON312)" >&2
      exit 3
    fi
    VENV="${GUESTD_OH_VENV:-.venv-oh}"
    REQS=scripts/openhands-requirements.txt
    ;;
  *)
    echo "usage: $0 [openhands]" >&2
    exit 2
    ;;
esac
want=$( (cat "$REQS" pyproject.toml; "$PY" -VV) | sha256sum | cut -d' ' -f1)
stamp="$VENV/.guestd-int-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV" || { echo "$PY -m venv failed" >&2; exit 3; }
log="$VENV/install.log"
echo "installing the integration venv $VENV (log: $log)" >&2
# guestd itself is not installed (pip install -e . rebuilds the native spawn module in the checkout,
# rewriting in place a .so that the suites running beside this build have mapped): its dependencies
# are, and a .pth puts the checkout on the venv's path.
deps=$("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
# shellcheck disable=SC2086 # one requirement per word; none holds a space
if ! "$VENV/bin/python" -m pip install --disable-pip-version-check $deps -r "$REQS" >"$log" 2>&1 \
  || ! "$VENV/bin/python" -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/guestd-checkout.pth", "w").write(sys.argv[1] + "\n")' "$PWD"; then
  tail -n 5 "$log" >&2
  echo "could not install the agent frameworks (PyPI unreachable?); full log in $log" >&2
  exit 3
fi
echo "$want" >"$stamp"
