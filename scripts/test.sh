#!/usr/bin/env bash
# The whole test suite: tidy checks, unit and behaviour tests of every crate,
# then the multi-process cluster tests against a server built with crash points.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/tidy.sh

echo "test: crate tests"
cargo test --workspace --exclude logdex-cluster-tests

# The cluster tests drive a server built with `--features failpoints` (crash points armed
# through FAILPOINTS, cluster-tests/README.md). Built after the crate tests, which rebuild
# target/debug/logdex without the feature, and copied, so nothing rebuilds it under them.
echo "test: building the logdex binary with crash points (--features failpoints)"
cargo build -p logdex-api --bin logdex --features failpoints
cp target/debug/logdex target/debug/logdex-failpoints
export LOGDEX_BIN="$PWD/target/debug/logdex-failpoints"

# The S3-compatible object store of the tiered storage test (cluster-tests/src/s3.rs), from PyPI.
if [ -z "${LOGDEX_S3_SERVER:-}" ] && ! python3 -c 'import moto.server' 2>/dev/null; then
  echo "test: installing moto's S3 server (pip install 'moto[server]'), the object store of the tiered storage test"
  python3 -m pip install --quiet --disable-pip-version-check 'moto[server]==5.2.1'
fi

echo "test: cluster tests (real processes on loopback, one test at a time, server $LOGDEX_BIN)"
cargo test -p logdex-cluster-tests -- --test-threads=1
