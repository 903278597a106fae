#!/usr/bin/env bash
# Runs nexar-rdma's tests with one of its features on: `.ci/rdma-tests.sh FEATURE [--lib] [FILTER]`.
#
# `cargo test -p nexar-rdma --features FEATURE` would resolve features for nexar-rdma alone and
# so build nexar and its dependencies a second time (and a third for the next feature). Built
# as part of the workspace instead (`--workspace --features nexar-rdma/FEATURE`), every other
# crate keeps the features `cargo test --workspace` gave it and is reused: only nexar-rdma is
# built again. Then only nexar-rdma's test binaries run (`--lib`: its unit tests alone), with
# FILTER as cargo test's name filter.
set -euo pipefail
cd "$(dirname "$0")/.."
feature=${1:?usage: .ci/rdma-tests.sh FEATURE [--lib] [FILTER]}
shift
only_lib=0
if [ "${1:-}" = "--lib" ]; then
  only_lib=1
  shift
fi
filter=("$@")

# Diagnostics still go to stderr; stdout carries one JSON message per built artifact. Kept in
# a file first, so that a build that fails stops the script (a failure inside `< <(...)` would not).
artifacts=$(mktemp)
trap 'rm -f "$artifacts"' EXIT
cargo test --workspace --features "nexar-rdma/$feature" --no-run --message-format=json-render-diagnostics >"$artifacts"
mapfile -t bins < <(
  python3 -c '
import json, sys
only_lib = sys.argv[1] == "1"
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    if not msg["profile"]["test"] or not msg["manifest_path"].endswith("/nexar-rdma/Cargo.toml"):
        continue
    if only_lib and "lib" not in msg["target"]["kind"]:
        continue
    print(msg["executable"])
' "$only_lib" <"$artifacts"
)
if [ ${#bins[@]} -eq 0 ]; then
  echo "no nexar-rdma test binary was built with feature $feature" >&2
  exit 1
fi
# As cargo test runs them: from the package's directory, with its manifest directory set.
cd nexar-rdma
export CARGO_MANIFEST_DIR="$PWD"
for bin in "${bins[@]}"; do
  echo "running $bin ${filter[*]:-}"
  "$bin" "${filter[@]}"
done
