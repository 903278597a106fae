#!/usr/bin/env bash
# The default build of every workspace member must need nothing but cargo and a C compiler:
# no `-sys` crate that wants cmake, libclang, pkg-config or a system library. Runs before CI
# installs anything, so a fresh machine with only a Rust toolchain is what it checks against.
#
# A `-sys` crate is allowed here only with the reason it needs no more than `cc`.
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A allowed=(
  [aws-lc-sys]="builds AWS-LC with the cc crate (its cmake path is only for FIPS builds)"
  [linux-raw-sys]="pure Rust bindings, no C at all"
)
found=$(cargo tree --workspace -e normal,build,dev --prefix none --format '{p}' | awk '{print $1}' | grep -E -- '-sys$' | sort -u || true)
bad=0
for crate in $found; do
  if [ -n "${allowed[$crate]:-}" ]; then
    echo "default build: $crate (${allowed[$crate]})"
  else
    echo "default build depends on $crate, which may need a C toolchain beyond cc:" >&2
    cargo tree --workspace -e normal,build,dev -i "$crate" >&2 || true
    bad=1
  fi
done
if ! command -v cmake >/dev/null 2>&1; then
  echo "default build: checked on a machine without cmake"
fi
exit "$bad"
