#!/usr/bin/env bash
# Style and structure checks: formatting, clippy, and the dependency direction
# api -> raft -> {log, index} (ARCHITECTURE.md), checked on direct dependencies
# (a crate can only name its direct dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "tidy: cargo fmt --check"
cargo fmt --all -- --check

echo "tidy: dependency direction"
fail=0
for crate in logdex-log logdex-index; do
  deps=$(cargo tree -p "$crate" -e normal --depth 1 --prefix none --format '{p}' | awk '{print $1}' | sort -u)
  for banned in logdex-log logdex-index logdex-raft logdex-api openraft tonic axum; do
    [ "$banned" = "$crate" ] && continue
    if grep -qx "$banned" <<<"$deps"; then
      echo "tidy: $crate must not depend on $banned" >&2
      fail=1
    fi
  done
done
raft_deps=$(cargo tree -p logdex-raft -e normal --depth 1 --prefix none --format '{p}' | awk '{print $1}' | sort -u)
for banned in logdex-api axum; do
  if grep -qx "$banned" <<<"$raft_deps"; then
    echo "tidy: logdex-raft must not depend on $banned" >&2
    fail=1
  fi
done
for dir in log index raft api cluster-tests; do
  grep -q "^### \`$dir/\`" ARCHITECTURE.md || { echo "tidy: ARCHITECTURE.md lacks a code-map entry for $dir/" >&2; fail=1; }
done
[ "$fail" = 0 ]

echo "tidy: cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "tidy: cargo clippy (failpoints build)"
cargo clippy -p logdex-api --all-targets --features failpoints --quiet -- -D warnings
echo "tidy: ok"
