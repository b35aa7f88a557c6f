#!/usr/bin/env bash
# The whole test suite: tidy checks, unit and behaviour tests of every crate,
# then the multi-process cluster tests against the built binary.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/tidy.sh

echo "test: building the logdex binary"
cargo build -p logdex-api --bin logdex
export LOGDEX_BIN="$PWD/target/debug/logdex"

echo "test: crate tests"
cargo test --workspace --exclude logdex-cluster-tests

echo "test: cluster tests (real processes on loopback, one test at a time)"
cargo test -p logdex-cluster-tests -- --test-threads=1
