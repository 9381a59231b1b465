#!/usr/bin/env bash
# Set up and run every check: lint, types, and the test suite against real guestd processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Byte-compiled once here: the suite starts guestd, kernels and helper scripts hundreds of times,
# and where PYTHONDONTWRITEBYTECODE is set (CI's environment) each start compiled every module
# again (0.44 s instead of 0.24 s for the server's imports, more on a loaded machine).
.venv/bin/python -m compileall -q -j 0 guestd tests protocol bench examples >/dev/null
# bash_kernel (the dev extra) is the foreign kernelspec of tests/test_code_kernels.py; its kernelspec
# goes into the venv (sys.prefix/share/jupyter), where guestd looks. Without it those tests skip.
.venv/bin/python -m bash_kernel.install --sys-prefix >/dev/null 2>&1 \
  || echo "== bash_kernel's kernelspec could not be installed: the foreign-kernel tests will skip"
# The QEMU guest suite (tests/qemu) needs these, the file-system tests a FUSE file system
# without O_TMPFILE (bindfs), the port tests a headless browser (chromium); as root on Debian
# they are installed here (a test that needs one that could not be installed skips).
need=""
for t in qemu-system-x86_64:qemu-system-x86 busybox:busybox-static cpio:cpio modprobe:kmod debootstrap:debootstrap bindfs:bindfs chromium:chromium rg:ripgrep; do
  command -v "${t%%:*}" >/dev/null 2>&1 || need="$need ${t#*:}"
done
if [ -n "$need" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing$need (for the QEMU guest suite, the file-system and the port tests)"
    apt-get install -y -q $need >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $need >/dev/null; } \
      || echo "== could not install some of$need: the tests that need them skip"
  else
    echo "== QEMU guest suite will be skipped: missing$need (install them as root)"
  fi
fi
# Each on a line of its own: under set -e a failure on the left of && does not stop the script
# (a lint error once went by with the suites green).
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"; .venv/bin/mypy
.venv/bin/python -c 'from guestd.children import _clone' 2>/dev/null \
  || echo "== note: the clone3 spawn extension was not built (no gcc?): guestd spawns through subprocess"
if [ "$#" != 0 ]; then
  echo "== pytest $*"; exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
# The QEMU guest suite is mostly TCG boots waiting on one core: it runs beside the host suite, and
# the subprocess-spawn fallback after it, in a shell of their own whose log is printed at the end;
# that keeps the whole run within CI's 30 minutes.
side_log=$(mktemp /tmp/guestd-side-suites.XXXXXX)
(
  rc=0
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/qemu || rc=$?
  # The subprocess fallback (machines where the C extension cannot be built) keeps its promises too.
  echo "== pytest, spawn fallback (GUESTD_NATIVE_SPAWN=0)"
  GUESTD_NATIVE_SPAWN=0 .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_exec.py tests/test_processes.py tests/test_shells.py tests/test_containment.py tests/test_runs.py \
    tests/test_workload_grep.py || rc=$?
  exit "$rc"
) >"$side_log" 2>&1 &
side_pid=$!
# The integration venvs (guestd.integrations against the real frameworks, pinned in
# scripts/*-requirements.txt) are built beside the suites too: pip mostly waits on the network.
# Exit 3 from a build: it could not be made (no PyPI, no Python 3.12), and those tests skip.
int_log=$(mktemp /tmp/guestd-int-venvs.XXXXXX)
(
  rc=0
  bash scripts/bootstrap-integrations.sh || rc=$?
  echo "$rc" >"$int_log.int"
  rc=0
  bash scripts/bootstrap-integrations.sh openhands || rc=$?
  echo "$rc" >"$int_log.oh"
) >"$int_log" 2>&1 &
int_pid=$!
trap 'pkill -TERM -P "$side_pid" 2>/dev/null; kill "$side_pid" "$int_pid" 2>/dev/null || true' EXIT
echo "== pytest (host suite; the QEMU guest suite and the spawn fallback run beside it, pid $side_pid)"
host_rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider --ignore=tests/qemu || host_rc=$?
wait "$int_pid" || true
cat "$int_log"
int_rc=$(cat "$int_log.int" 2>/dev/null || echo 3)
oh_rc=$(cat "$int_log.oh" 2>/dev/null || echo 3)
rm -f "$int_log" "$int_log.int" "$int_log.oh"
echo "== integrations: SWE-ReX, mini-swe-agent (.venv-int)"
if [ "$int_rc" = 0 ]; then
  .venv-int/bin/mypy guestd/integrations tests/test_integrations_swerex.py tests/test_integrations_minisweagent.py \
    tests/qemu/test_swerex.py
  # tests/qemu/test_swerex.py: SWE-ReX's deployment on a QEMU guest (one VM boot, ~1 min)
  .venv-int/bin/python -m pytest -q -p no:cacheprovider -rs -o asyncio_mode=auto -o asyncio_default_fixture_loop_scope=function \
    tests/test_integrations_swerex.py tests/test_integrations_minisweagent.py tests/qemu/test_swerex.py
else
  echo "== integration tests SKIPPED: the integration venv could not be built (exit $int_rc; see above)"
fi
# The OpenHands SDK needs Python >= 3.12 (the main venv is 3.11): a venv of its own.
echo "== integrations: OpenHands SDK (.venv-oh)"
if [ "$oh_rc" = 0 ]; then
  .venv-oh/bin/mypy --python-version 3.12 guestd/integrations/openhands.py guestd/integrations/_openhands_git.py \
    tests/test_integrations_openhands.py
  .venv-oh/bin/python -m pytest -q -p no:cacheprovider -rs tests/test_integrations_openhands.py
else
  echo "== OpenHands integration tests SKIPPED: .venv-oh could not be built (exit $oh_rc; see above)"
fi
side_rc=0
wait "$side_pid" || side_rc=$?
trap - EXIT
echo "== pytest, QEMU guest suite (tests/qemu), then the spawn fallback: ran beside the host suite"
cat "$side_log"
rm -f "$side_log"
if [ "$host_rc" != 0 ] || [ "$side_rc" != 0 ]; then
  echo "== FAILED: host suite exit $host_rc, QEMU guest suite / spawn fallback exit $side_rc"
  exit 1
fi
