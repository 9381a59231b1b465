#!/usr/bin/env bash
# Set up and run every check: lint, types, and the test suite against real guestd processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy --strict"; .venv/bin/mypy
echo "== pytest"; .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
