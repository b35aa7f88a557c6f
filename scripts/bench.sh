#!/usr/bin/env bash
# Benchmarks (issue 8): logdex against the physical limit of this machine and
# against a peer, measured in one run on loopback:
#   1. builds the release binaries (logdex, and bench-peer/ for NATS);
#   2. raw fjall get floor: the index crate's benchmark (100,000 keys);
#   3. a 3-node logdex cluster: load (and load into a one-partition topic, reported
#      below the table), noop (the floor: GET /bench/noop, no work, measured after
#      the load and right before the lookups; once more before the load and after
#      everything, listed below the table),
#      get1 (linearizable, strict, follower; each lookup paired with a no-work call
#      to the same node, `--paired-floor`, the floor of its row), getc (linearizable,
#      follower), get1 and getc again over the gRPC client API (against the floor of
#      the gRPC no-work call, `Noop`); writes and linearizable lookups go to
#      the key's partition leader (`--route leader`, as a Kafka client routes), and once
#      more to any node (`--route any`, the node forwards; listed below the table); then recovery and rebuild
#      (a single node of their own with 1,000,000 keys);
#   4. a 3-node NATS JetStream cluster, KV bucket with 3 replicas: load, get1
#      (direct get), getc;
#   5. prints the table (logdex vs floor vs NATS, with ratios and targets).
# Every process it starts is stopped by PID on exit. Results and node logs are
# kept in target/bench/last/.
#
# Usage: scripts/bench.sh [--keys N] [--concurrency C] [--duration-secs S]
#                         [--get1-requests N] [--restart-keys N] [--skip-build] [--skip-nats] [--skip-fjall]
# Environment: BENCH_PORT_BASE (default 18100; uses BASE+81..83, +91..93, +21..23, +31..33).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

KEYS=100000
VALUE_BYTES=100
CONCURRENCY=32
DURATION_SECS=10
GET1_REQUESTS=20000
RESTART_KEYS=1000000
SKIP_BUILD=0
SKIP_NATS=0
SKIP_FJALL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --keys) KEYS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --duration-secs) DURATION_SECS=$2; shift 2 ;;
    --get1-requests) GET1_REQUESTS=$2; shift 2 ;;
    --restart-keys) RESTART_KEYS=$2; shift 2 ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --skip-nats) SKIP_NATS=1; shift ;;
    --skip-fjall) SKIP_FJALL=1; shift ;;
    *) echo "bench: unknown argument $1" >&2; exit 2 ;;
  esac
done

BASE=${BENCH_PORT_BASE:-18100}
HTTP_PORTS=($((BASE + 81)) $((BASE + 82)) $((BASE + 83)))
RPC_PORTS=($((BASE + 91)) $((BASE + 92)) $((BASE + 93)))
NATS_PORTS=($((BASE + 21)) $((BASE + 22)) $((BASE + 23)))
NATS_ROUTE_PORTS=($((BASE + 31)) $((BASE + 32)) $((BASE + 33)))

WORK=$(mktemp -d /tmp/logdex-bench.XXXXXX)
OUT=$ROOT/target/bench/last
RESULTS=$OUT/results.jsonl
PIDS=()

stop_pids() {
  local pid
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "$@"; do
    for _ in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}

cleanup() {
  if [ ${#PIDS[@]} -gt 0 ]; then stop_pids "${PIDS[@]}"; fi
  PIDS=()
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_http() { # URL SECONDS
  local deadline=$((SECONDS + $2))
  until curl -fs -o /dev/null --max-time 2 "$1" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || { echo "bench: $1 not ready after $2 s" >&2; return 1; }
    sleep 0.5
  done
}

wait_port() { # PORT SECONDS
  local deadline=$((SECONDS + $2))
  until ! port_free "$1"; do
    [ $SECONDS -lt $deadline ] || { echo "bench: port $1 not listening after $2 s" >&2; return 1; }
    sleep 0.2
  done
}

for p in "${HTTP_PORTS[@]}" "${RPC_PORTS[@]}" "${NATS_PORTS[@]}" "${NATS_ROUTE_PORTS[@]}"; do
  port_free "$p" || { echo "bench: port $p on 127.0.0.1 is in use (set BENCH_PORT_BASE)" >&2; exit 1; }
done
mkdir -p "$OUT"
rm -f "$RESULTS" "$OUT"/*.log "$OUT"/fjall.txt

echo "bench: machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(free -g | awk '/^Mem:/ {print $2}') GiB"

# ---------------------------------------------------------------- build
if [ "$SKIP_BUILD" = 0 ]; then
  echo "bench: building release binaries"
  cargo build --release -p logdex-api --bin logdex
  if [ "$SKIP_NATS" = 0 ]; then
    CARGO_TARGET_DIR="$ROOT/target" cargo build --release --manifest-path bench-peer/Cargo.toml
  fi
fi
LOGDEX=$ROOT/target/release/logdex
PEER=$ROOT/target/release/bench-peer

# ---------------------------------------------------------------- fjall floor
if [ "$SKIP_FJALL" = 0 ]; then
  echo "bench: raw fjall get floor (cargo bench -p logdex-index, $KEYS keys)"
  cargo bench -p logdex-index --bench index_bench -- --keys "$KEYS" --skip-idle >"$OUT/fjall.txt" 2>"$OUT/fjall.log"
  grep -E '^\| random get' "$OUT/fjall.txt" || true
fi

# ---------------------------------------------------------------- logdex
echo "bench: starting a 3-node logdex cluster on 127.0.0.1:${HTTP_PORTS[0]}-${HTTP_PORTS[2]}"
PEERS="1@127.0.0.1:${RPC_PORTS[0]},2@127.0.0.1:${RPC_PORTS[1]},3@127.0.0.1:${RPC_PORTS[2]}"
LOGDEX_PIDS=()
for i in 1 2 3; do
  "$LOGDEX" serve --node-id "$i" --data-dir "$WORK/logdex-$i" \
    --http-addr "127.0.0.1:${HTTP_PORTS[$((i - 1))]}" --rpc-addr "127.0.0.1:${RPC_PORTS[$((i - 1))]}" \
    --peers "$PEERS" </dev/null >"$OUT/logdex-$i.log" 2>&1 &
  LOGDEX_PIDS+=($!)
  PIDS+=($!)
done
URLS=()
for p in "${HTTP_PORTS[@]}"; do
  wait_http "http://127.0.0.1:$p/readyz" 60
  URLS+=(--url "http://127.0.0.1:$p")
done

run_logdex() {
  echo "bench: logdex bench $*"
  "$LOGDEX" bench "$@" "${URLS[@]}" --keys "$KEYS" --value-bytes "$VALUE_BYTES" --json | tee -a "$RESULTS"
}
# The floor on the fresh cluster, for reference (listed below the table).
run_logdex noop --concurrency 1 --requests "$GET1_REQUESTS" --label floor-before
run_logdex load --concurrency "$CONCURRENCY"
# The same load into a topic of one partition: one Raft group, as NATS's KV bucket is one stream.
run_logdex load --concurrency "$CONCURRENCY" --topic bench-one-partition --partitions 1 --label logdex-one-partition
# The floor the lookups are compared with, measured right before them on the same loaded
# cluster (the nodes' background work after a load, flushes and checkpoints, slows both).
# get1 pairs each lookup with a no-work call (--paired-floor): the single-client floor moves
# by a third over a run, so its rows are compared with the calls sent alongside them.
run_logdex noop --concurrency 1 --requests "$GET1_REQUESTS"
run_logdex noop --concurrency "$CONCURRENCY" --duration-secs "$DURATION_SECS"
run_logdex get1 --read linearizable,strict,follower --requests "$GET1_REQUESTS" --paired-floor
run_logdex getc --read linearizable,follower --concurrency "$CONCURRENCY" --duration-secs "$DURATION_SECS"
# The same lookups over the gRPC client API (served on the RPC ports).
GRPC_URLS=()
for p in "${RPC_PORTS[@]}"; do GRPC_URLS+=(--url "http://127.0.0.1:$p"); done
# The admin URL tells the gRPC runs which node leads each partition.
GRPC_URLS+=(--admin-url "http://127.0.0.1:${HTTP_PORTS[0]}")
echo "bench: logdex bench noop/get1/getc --protocol grpc"
# The gRPC rows' floor: the no-work call over the same gRPC client and server.
"$LOGDEX" bench noop --protocol grpc --concurrency 1 --requests "$GET1_REQUESTS" "${GRPC_URLS[@]}" --json \
  | tee -a "$RESULTS"
"$LOGDEX" bench noop --protocol grpc --concurrency "$CONCURRENCY" --duration-secs "$DURATION_SECS" \
  "${GRPC_URLS[@]}" --json | tee -a "$RESULTS"
"$LOGDEX" bench get1 --protocol grpc --read linearizable,follower --requests "$GET1_REQUESTS" --paired-floor \
  "${GRPC_URLS[@]}" --keys "$KEYS" --value-bytes "$VALUE_BYTES" --json | tee -a "$RESULTS"
"$LOGDEX" bench getc --protocol grpc --read linearizable,follower --concurrency "$CONCURRENCY" \
  --duration-secs "$DURATION_SECS" "${GRPC_URLS[@]}" --keys "$KEYS" --value-bytes "$VALUE_BYTES" --json | tee -a "$RESULTS"
# The same writes and linearizable lookups from a client that does not know the leaders:
# requests rotate over the nodes, which forward them to the leader (listed below the table).
run_logdex get1 --read linearizable,strict --requests "$GET1_REQUESTS" --route any --label logdex-any-node
run_logdex getc --read linearizable --concurrency "$CONCURRENCY" --duration-secs "$DURATION_SECS" \
  --route any --label logdex-any-node
run_logdex load --concurrency "$CONCURRENCY" --topic bench-any-node --route any --label logdex-any-node
# The floor again after the load, to show the machine did not change under the run.
run_logdex noop --concurrency 1 --requests "$GET1_REQUESTS" --label floor-after
du -sh "$WORK"/logdex-* | sed 's/^/bench: data /'
stop_pids "${LOGDEX_PIDS[@]}"
PIDS=()

# ---------------------------------------------------------------- restarts
# A node of its own with --restart-keys keys: ready after a clean stop and after kill -9, and
# the index rebuilt from the log after it was deleted.
echo "bench: logdex bench recovery / rebuild ($RESTART_KEYS keys, a single node of their own)"
"$LOGDEX" bench recovery --keys "$RESTART_KEYS" --value-bytes "$VALUE_BYTES" --json | tee -a "$RESULTS"
"$LOGDEX" bench rebuild --keys "$RESTART_KEYS" --value-bytes "$VALUE_BYTES" --json | tee -a "$RESULTS"

# ---------------------------------------------------------------- NATS
if [ "$SKIP_NATS" = 0 ]; then
  if ! command -v nats-server >/dev/null; then
    echo "bench: installing nats-server (Debian package)"
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && apt-get install -y -qq nats-server >/dev/null
    else
      sudo apt-get update -qq && sudo apt-get install -y -qq nats-server >/dev/null
    fi
  fi
  echo "bench: starting a 3-node NATS JetStream cluster ($(nats-server --version)) on 127.0.0.1:${NATS_PORTS[0]}-${NATS_PORTS[2]}"
  ROUTES="nats-route://127.0.0.1:${NATS_ROUTE_PORTS[0]}, nats-route://127.0.0.1:${NATS_ROUTE_PORTS[1]}, nats-route://127.0.0.1:${NATS_ROUTE_PORTS[2]}"
  NATS_PIDS=()
  for i in 1 2 3; do
    mkdir -p "$WORK/nats-$i"
    cat >"$WORK/nats-$i.conf" <<EOF
server_name: n$i
listen: 127.0.0.1:${NATS_PORTS[$((i - 1))]}
jetstream {
  store_dir: "$WORK/nats-$i"
  max_memory_store: 1GB
  max_file_store: 10GB
}
cluster {
  name: bench
  listen: 127.0.0.1:${NATS_ROUTE_PORTS[$((i - 1))]}
  routes: [$ROUTES]
}
EOF
    nats-server -c "$WORK/nats-$i.conf" </dev/null >"$OUT/nats-$i.log" 2>&1 &
    NATS_PIDS+=($!)
    PIDS+=($!)
  done
  NATS_URLS=()
  for p in "${NATS_PORTS[@]}"; do
    wait_port "$p" 30
    NATS_URLS+=(--url "nats://127.0.0.1:$p")
  done
  run_peer() {
    echo "bench: bench-peer $*"
    "$PEER" "$@" "${NATS_URLS[@]}" --keys "$KEYS" --value-bytes "$VALUE_BYTES" --json | tee -a "$RESULTS"
  }
  run_peer load --concurrency "$CONCURRENCY"
  run_peer get1 --requests "$GET1_REQUESTS"
  run_peer getc --concurrency "$CONCURRENCY" --duration-secs "$DURATION_SECS"
  stop_pids "${NATS_PIDS[@]}"
  PIDS=()
fi

# ---------------------------------------------------------------- table
echo
echo "## logdex vs the no-work floor vs $( [ "$SKIP_NATS" = 0 ] && echo 'NATS JetStream KV' || echo 'no peer' )"
echo "($KEYS keys of $VALUE_BYTES random bytes, $CONCURRENCY clients for load and getc, $GET1_REQUESTS requests for get1; latencies in microseconds)"
echo
"$LOGDEX" bench report --input "$RESULTS"
if [ -s "$OUT/fjall.txt" ]; then
  echo
  echo "raw fjall floor (logdex-index benchmark, same machine, before the clusters started):"
  grep -E '^\|( measure|---| random get)' "$OUT/fjall.txt" || true
fi
echo
echo "bench: results in $RESULTS"
