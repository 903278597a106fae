#!/usr/bin/env bash
# Two-level collectives between real hosts: four ranks on two hosts (two network namespaces,
# two ranks each) and the seed on a third, joined by a bridge in a "switch" namespace. Ranks of
# one namespace share a host (shared memory between them); ranks of different namespaces
# talk over TLS on their own addresses. For each collective, nexar-bench runs and checks every
# element (i32: bitwise), and rank 0 reports which algorithm ran at each size; then typed
# point-to-point messages go around the ranks, within and between the hosts.
#
#   bash nexar/tests/scripts/netns_hosts.sh [path/to/nexar] [path/to/nexar-bench]
#
# NETNS_ITERS (default 3) sets the iterations per size, NETNS_OPS the collectives to run.
#
# Needs root and `ip netns`; otherwise it says so and exits 0 without running.
set -euo pipefail

BIN=$(realpath "${1:-target/debug/nexar}")
BENCH=$(realpath "${2:-target/debug/nexar-bench}")
PREFIX=nxh$$
NET=198.18.78

# shellcheck source=netns_lib.sh
. "$(dirname "$0")/netns_lib.sh"
netns_setup "$PREFIX" "$NET" 3 "netns hosts test"
SEED_ADDR="$NET.1:7100"
failed=0

# One cluster per collective: the seed on host 0, ranks on hosts 1 and 2 (two each).
run_op() {
  local op=$1 want=$2
  netns_seed "${PREFIX}h0" "$BIN" "$SEED_ADDR" 4 "$LOG/seed-$op"
  local token=$SEED_TOKEN
  if [ -z "$token" ]; then
    echo "netns hosts test: the seed printed no token for $op"
    cat "$LOG/seed-$op"
    failed=1
    return
  fi
  local pids=() n=0
  for host in 1 1 2 2; do
    (cd "$LOG" && NEXAR_TOKEN="$token" NEXAR_LISTEN_ADDR="$NET.$((host + 1)):0" \
      ip netns exec "${PREFIX}h$host" timeout 120 "$BENCH" --worker --seed "$SEED_ADDR" --op "$op" -d i32 \
      -b 4K -e 4M -f 32 -n "${NETNS_ITERS:-3}" -w 1 --links --json "$LOG/$op.json" >"$LOG/w$n-$op" 2>&1) &
    pids+=($!)
    n=$((n + 1))
  done
  local status=0
  netns_wait "${pids[@]}" || status=1
  cat "$LOG"/w*-"$op"
  local out
  out=$(cat "$LOG"/w*-"$op")
  if [ $status -ne 0 ]; then
    echo "netns hosts test: $op FAILED (a process failed)"
    cat "$LOG/seed-$op"
    failed=1
  elif ! grep -q '^# wrong results *: 0 OK' <<<"$out"; then
    echo "netns hosts test: $op FAILED (wrong elements)"
    failed=1
  elif [ "$want" != - ] && ! grep -q "^# algorithm: .*$want" <<<"$out"; then
    echo "netns hosts test: $op FAILED (no $want in the algorithms that ran)"
    failed=1
  elif [ "$(grep -c '^# links of rank' <<<"$out")" != 4 ] \
    || [ "$(grep '^# links of rank' <<<"$out" | grep -o ' shm' | wc -l)" != 4 ] \
    || [ "$(grep '^# links of rank' <<<"$out" | grep -o ' tcp-tls' | wc -l)" != 8 ] \
    || [ "$(grep -c 'of 2 with ranks' <<<"$out")" != 4 ]; then
    # Each rank: its host's other rank over shared memory, the other host's two over TLS.
    echo "netns hosts test: $op FAILED (links or host layout not as placed)"
    failed=1
  else
    echo "netns hosts test: $op ok"
  fi
}

for op in ${NETNS_OPS:-allreduce broadcast reduce allgather reduce_scatter alltoall}; do
  run_op "$op" hierarchical
done
# Point-to-point around the ring of ranks (0 -> 1 within host 1, 1 -> 2 and 3 -> 0 between the
# hosts, over the TCP lane; 4 MiB in segments): every element checked.
[ -n "${NETNS_OPS:-}" ] || run_op sendrecv -

if [ $failed -ne 0 ]; then
  echo "netns hosts test: FAILED"
  exit 1
fi
echo "netns hosts test: passed (4 ranks on 2 namespace hosts, shared memory within, TLS between; two-level allreduce, broadcast, reduce, all-gather, reduce-scatter, all-to-all and point-to-point checked)"
