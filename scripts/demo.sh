#!/usr/bin/env bash
# Set up, start guestd for real on a local Unix socket, and drive it with guestctl.
#
#   scripts/demo.sh          on a terminal: guestd keeps serving until Ctrl-C; otherwise it is
#                            stopped at the end (and the last line says so)
#   scripts/demo.sh --keep   guestd keeps serving after the script ends (the last lines say how
#                            to reach it and how to stop it)
#
# Every command is echoed so it can be pasted back into a shell (arguments quoted with %q).
set -euo pipefail
keep=0
for arg in "$@"; do
  case "$arg" in
    --keep) keep=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $arg (try --keep)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
dir="$PWD/.guestd-demo"
mkdir -p "$dir"
sock="$dir/guestd.sock"
export GUESTD_CONNECT="unix:$sock"
if [ "$keep" = 1 ]; then
  # Its own session: it outlives this script and the terminal's Ctrl-C.
  setsid .venv/bin/guestd --listen "unix:$sock" >"$dir/guestd.log" 2>&1 </dev/null &
else
  .venv/bin/guestd --listen "unix:$sock" >"$dir/guestd.log" 2>&1 &
fi
pid=$!
stopped() {
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  printf '\nguestd (pid %s) stopped (scripts/demo.sh --keep leaves it running)\n' "$pid"
}
[ "$keep" = 1 ] || trap stopped EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
gc=.venv/bin/guestctl
# One argument as a shell reads it back: as it is when plain, else in single quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
# The command as it can be pasted back (bold on a terminal), then run.
run() {
  local line="" arg
  for arg in "$@"; do line+="${line:+ }$(quote "$arg")"; done
  if [ -t 1 ]; then printf '\n\033[1m$ %s\033[0m\n' "$line"; else printf '\n$ %s\n' "$line"; fi
  "$@"
}
printf '$ export GUESTD_CONNECT=%s\n' "$(quote "$GUESTD_CONNECT")"
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
printf '\nguestd (pid %s) is serving %s; log: %s\n' "$pid" "$GUESTD_CONNECT" "$dir/guestd.log"
if [ "$keep" = 0 ] && [ ! -t 0 ]; then
  exit 0  # the EXIT trap stops it and says so
fi
if [ "$keep" = 1 ]; then
  printf 'It keeps running. Try:\n  GUESTD_CONNECT=%s %s info\nStop it with:\n  kill %s\n' \
    "$(quote "$GUESTD_CONNECT")" "$(quote "$PWD/$gc")" "$pid"
else
  printf 'Try, in another shell:\n  GUESTD_CONNECT=%s %s info\n(Ctrl-C here stops guestd)\n' \
    "$(quote "$GUESTD_CONNECT")" "$(quote "$PWD/$gc")"
  wait "$pid" || true
fi
