#!/usr/bin/env bash
# A slow link between two hosts: collectives that take several times the failure detector's
# timeouts must finish, with no peer declared dead. Two ranks on two network-namespace hosts
# (and the seed on a third), each host's interface limited to RATE by a token-bucket filter
# (`tc qdisc ... tbf`), so that the heartbeats and the QUIC keep-alives queue behind the
# lane's bulk bytes as they would on a busy 1 GbE link. The ranks run with a heartbeat timeout
# and a QUIC idle timeout of 2.5 s each (short enough to be outlasted twice, long enough that
# a CI machine busy with other tests does not starve a rank for that long); a 64 MiB broadcast
# and a 64 MiB allreduce at 100 Mbit/s take about 5.6 s each.
#
#   bash nexar/tests/scripts/netns_slow_link.sh [path/to/nexar] [path/to/nexar-bench]
#
# Needs root and `ip netns`; otherwise it says so and exits 0 without running. A kernel without
# the tbf queueing discipline cannot limit the rate: the script says so and exits 0 too.
set -euo pipefail

BIN=$(realpath "${1:-target/debug/nexar}")
BENCH=$(realpath "${2:-target/debug/nexar-bench}")
PREFIX=nxl$$
NET=198.18.79
RATE=${SLOW_LINK_RATE:-100mbit}
SIZE=${SLOW_LINK_SIZE:-64M}
# Each collective must take at least this long (µs) for the test to mean anything: twice the
# heartbeat timeout below.
MIN_US=5000000

# shellcheck source=netns_lib.sh
. "$(dirname "$0")/netns_lib.sh"
netns_setup "$PREFIX" "$NET" 3 "slow link test"
for host in 1 2; do
  if ! ip netns exec "${PREFIX}h$host" tc qdisc add dev eth0 root tbf rate "$RATE" burst 64kb latency 20ms; then
    echo "slow link test: not run (this kernel cannot limit a link's rate: no tbf queueing discipline)" >&2
    echo "slow link test: not run (no tbf)"
    exit 0
  fi
done

SEED_ADDR="$NET.1:7200"
failed=0

run_op() {
  local op=$1
  netns_seed "${PREFIX}h0" "$BIN" "$SEED_ADDR" 2 "$LOG/seed-$op"
  local token=$SEED_TOKEN
  if [ -z "$token" ]; then
    echo "slow link test: the seed printed no token for $op"
    cat "$LOG/seed-$op"
    failed=1
    return
  fi
  local pids=()
  for host in 1 2; do
    (cd "$LOG" && NEXAR_TOKEN="$token" NEXAR_LISTEN_ADDR="$NET.$((host + 1)):0" \
      NEXAR_HEARTBEAT_INTERVAL_MS=500 NEXAR_HEARTBEAT_TIMEOUT_MS=2500 NEXAR_IDLE_TIMEOUT_MS=2500 \
      ip netns exec "${PREFIX}h$host" timeout 120 "$BENCH" --worker --seed "$SEED_ADDR" --op "$op" \
      -b "$SIZE" -e "$SIZE" -n 1 -w 0 --json "$LOG/$op-$host.json" >"$LOG/w$host-$op" 2>&1) &
    pids+=($!)
  done
  local status=0
  netns_wait "${pids[@]}" || status=1
  local out
  out=$(cat "$LOG"/w*-"$op")
  echo "$out"
  local time_us
  # Rank 0 writes the JSON, on whichever host it joined from.
  time_us=$(cat "$LOG/$op"-*.json 2>/dev/null | sed -n 's/.*"time_us": *\([0-9.]*\).*/\1/p' | head -1 || true)
  if [ $status -ne 0 ]; then
    echo "slow link test: $op FAILED (a process failed)"
    cat "$LOG/seed-$op"
    failed=1
  elif ! grep -q '^# wrong results *: 0 OK' <<<"$out"; then
    echo "slow link test: $op FAILED (wrong elements)"
    failed=1
  elif grep -qi 'declared dead\|is gone\|lost' <<<"$out"; then
    echo "slow link test: $op FAILED (a peer was declared dead during the transfer)"
    failed=1
  elif [ -z "$time_us" ] || [ "${time_us%.*}" -lt $MIN_US ]; then
    echo "slow link test: $op FAILED (took ${time_us:-?} us, under ${MIN_US} us: the link was not slow, so this proves nothing)"
    failed=1
  else
    echo "slow link test: $op ok (${time_us} us at $RATE)"
  fi
}

for op in broadcast allreduce; do
  run_op "$op"
done
if [ $failed -ne 0 ]; then
  echo "slow link test: FAILED"
  exit 1
fi
echo "slow link test: passed (a $SIZE broadcast and allreduce at $RATE between two namespace hosts, each several heartbeat and idle timeouts long, with no peer declared dead)"
