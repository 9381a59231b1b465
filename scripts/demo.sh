#!/usr/bin/env bash
# Set up, start guestd for real on a local Unix socket, and drive it with guestctl.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
dir="$PWD/.guestd-demo"
mkdir -p "$dir"
sock="$dir/guestd.sock"
export GUESTD_CONNECT="unix:$sock"
.venv/bin/guestd --listen "unix:$sock" >"$dir/guestd.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
gc=.venv/bin/guestctl
run() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }
run $gc ping
run $gc sh 'echo "hello from $(hostname) as $(id -un), pid $$"; uname -sr'
run $gc --json exec --max-output 32 -- sh -c 'seq 1 100000' || true
run $gc sh --timeout 1 'echo started; sleep 30 & sleep 30' || echo "(exit $?: the timeout ended the whole tree)"
head -c 8388608 /dev/urandom > "$dir/local.bin"
run $gc cp "$dir/local.bin" ":$dir/in-guest/copy.bin" --parents
run $gc cp ":$dir/in-guest/copy.bin" "$dir/roundtrip.bin"
run sha256sum "$dir/local.bin" "$dir/roundtrip.bin"
run $gc ls ":$dir/in-guest"
run $gc rm -r ":$dir/in-guest"
printf '\nguestd (pid %s) is serving unix:%s; log: %s\n' "$pid" "$sock" "$dir/guestd.log"
if [ -t 0 ]; then
  echo "Try: GUESTD_CONNECT=unix:$sock .venv/bin/guestctl info    (Ctrl-C here stops guestd)"
  wait $pid
fi
