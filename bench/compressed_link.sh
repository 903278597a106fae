#!/usr/bin/env bash
# The bf16-compressed allreduce against the uncompressed one where the link, not the memory,
# is the limit: two ranks on two hosts (network namespaces on a bridge, the seed on a third),
# each host's link shaped to RATE with tc's token bucket, collective payloads on the TCP lane.
# Alternates `--op allreduce` and `--op allreduce_bf16` ROUNDS times and prints each side's
# busbw (median and range over the rounds) and the ratio of the medians.
#
#   cargo build --release -p nexar --features cli --bins
#   bash bench/compressed_link.sh [target/release/nexar] [target/release/nexar-bench]
#
# RATE (tc rate, default 5gbit), SIZE (default 64M), ROUNDS (default 5), ITERS (per run,
# default 5). Needs root and `ip netns` / `tc`.
set -euo pipefail

BIN=$(realpath "${1:-target/release/nexar}")
BENCH=$(realpath "${2:-target/release/nexar-bench}")
RATE=${RATE:-5gbit}
SIZE=${SIZE:-64M}
ROUNDS=${ROUNDS:-5}
ITERS=${ITERS:-5}
PREFIX=nxc$$
NET=198.18.79

# shellcheck source=../nexar/tests/scripts/netns_lib.sh
. "$(dirname "$0")/../nexar/tests/scripts/netns_lib.sh"
if ! netns_usable "$PREFIX"; then
  echo "compressed_link: needs root and ip netns" >&2
  exit 1
fi
LOG=$(mktemp -d)
cleanup() {
  netns_remove "$PREFIX" 3
  rm -rf "$LOG"
}
trap cleanup EXIT
netns_hosts "$PREFIX" "$NET" 3
for host in 1 2; do
  # A bucket of a few milliseconds' worth at the rate, so that the shaping holds the rate
  # without dropping bursts the kernel's timer tick would otherwise cut.
  ip netns exec "${PREFIX}h$host" tc qdisc add dev eth0 root tbf rate "$RATE" burst 4mb latency 50ms
done
SEED_ADDR="$NET.1:7100"

# One run of `op` on a fresh cluster; prints rank 0's busbw in GB/s.
run() {
  local op=$1 token
  ip netns exec "${PREFIX}h0" timeout 300 "$BIN" seed --bind "$SEED_ADDR" --world-size 2 --exit-when-done \
    >"$LOG/seed" 2>&1 &
  local seed=$!
  for _ in $(seq 1 100); do grep -q '^token: ' "$LOG/seed" 2>/dev/null && break; sleep 0.1; done
  token=$(sed -n 's/^token: //p' "$LOG/seed")
  [ -n "$token" ] || { cat "$LOG/seed" >&2; exit 1; }
  local pids=()
  for host in 1 2; do
    (cd "$LOG" && NEXAR_TOKEN="$token" NEXAR_LISTEN_ADDR="$NET.$((host + 1)):0" \
      ip netns exec "${PREFIX}h$host" timeout 300 "$BENCH" --worker --seed "$SEED_ADDR" --op "$op" \
      -b "$SIZE" -e "$SIZE" -n "$ITERS" -w 1 >"$LOG/w$host" 2>&1) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$LOG"/w* >&2; exit 1; }; done
  wait "$seed" || true
  grep -q '^# wrong results *: 0 OK' "$LOG"/w* || { cat "$LOG"/w* >&2; exit 1; }
  # The size row: size, count, time, algbw, busbw, wrong.
  awk '$1 ~ /^[0-9]+$/ && NF >= 6 { print $5; exit }' "$LOG"/w*
}

plain=() compressed=()
for round in $(seq 1 "$ROUNDS"); do
  plain+=("$(run allreduce)")
  compressed+=("$(run allreduce_bf16)")
  echo "# round $round/$ROUNDS: allreduce ${plain[-1]} GB/s, bf16 ${compressed[-1]} GB/s" >&2
done
python3 - "$RATE" "$SIZE" "${plain[*]}" "${compressed[*]}" <<'PY'
import statistics, sys
rate, size, plain, compressed = sys.argv[1], sys.argv[2], [float(x) for x in sys.argv[3].split()], [float(x) for x in sys.argv[4].split()]
def show(v): return f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})"
print(f"# np 2 on two namespace hosts, links shaped to {rate}, {size} f32, TCP lane; busbw GB/s, median (min–max) of {len(plain)} alternated rounds")
print(f"allreduce        {show(plain)}")
print(f"allreduce_bf16   {show(compressed)}")
print(f"ratio            {statistics.median(compressed) / statistics.median(plain):.2f}")
PY
