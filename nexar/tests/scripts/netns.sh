#!/usr/bin/env bash
# A seed and three workers on four hosts, each host a network namespace with its own address,
# joined by a bridge in a fifth "switch" namespace. Workers bind their own interface address.
#
#   bash nexar/tests/scripts/netns.sh [path/to/nexar]
#
# Needs root and `ip netns`; otherwise it says so and exits 0 without running.
set -euo pipefail

BIN=${1:-target/debug/nexar}
PREFIX=nxt$$
NET=198.18.77
HOSTS=4

# shellcheck source=netns_lib.sh
. "$(dirname "$0")/netns_lib.sh"
if ! netns_usable "$PREFIX"; then
  echo "netns test: not run (needs root and ip netns on this machine)"
  exit 0
fi
cleanup() {
  netns_remove "$PREFIX" $HOSTS
  [ -n "${LOG:-}" ] && rm -rf "$LOG"
}
trap cleanup EXIT
netns_hosts "$PREFIX" "$NET" $HOSTS

LOG=$(mktemp -d)
SEED_ADDR="$NET.1:7000"
ip netns exec "${PREFIX}h0" timeout 120 "$BIN" seed --bind "$SEED_ADDR" --world-size 3 --exit-when-done >"$LOG/seed" 2>&1 &
SEED_PID=$!
for _ in $(seq 1 100); do grep -q '^token: ' "$LOG/seed" 2>/dev/null && break; sleep 0.1; done
TOKEN=$(sed -n 's/^token: //p' "$LOG/seed")
[ -n "$TOKEN" ] || { echo "netns test: the seed printed no token"; cat "$LOG/seed"; exit 1; }

pids=()
for i in 1 2 3; do
  NEXAR_TOKEN="$TOKEN" ip netns exec "${PREFIX}h$i" timeout 120 "$BIN" check --seed "$SEED_ADDR" \
    --listen "$NET.$((i + 1)):0" --big-mib 4 >"$LOG/w$i" 2>&1 &
  pids+=($!)
done
status=0
for i in 1 2 3; do
  if ! wait "${pids[$((i - 1))]}"; then status=1; fi
done
wait "$SEED_PID" || status=1
for i in 1 2 3; do cat "$LOG/w$i"; done
cat "$LOG/seed"
if [ $status -ne 0 ] || [ "$(cat "$LOG"/w* | grep -c "mesh check passed")" != 3 ]; then
  echo "netns test: FAILED"
  exit 1
fi
# Every peer address the seed published is a namespace address, not loopback.
if grep -q '127.0.0.1' "$LOG/seed"; then
  echo "netns test: FAILED (a loopback address was published)"
  exit 1
fi
echo "netns test: passed (seed and 3 workers on 4 namespaces, $NET.0/24)"
