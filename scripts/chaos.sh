#!/usr/bin/env bash
# Chaos soak and mutation check (cluster-tests/README.md).
#
#   scripts/chaos.sh --minutes N [--seed S] [--scenario NAME] [--keep-going]
#       Soak: mixed faults on 5 nodes (or one CI scenario with --scenario, repeated) in rounds of
#       at most 5 minutes, each checked, until N minutes are up. Round k uses seed S+k. It stops
#       at the first failed round, or with --keep-going runs on and reports every failed round.
#       Scenarios: baseline kill_one kill_all power_loss pause_leader isolate_leader flaky
#       snapshot_catchup partition_move mixed.
#   scripts/chaos.sh --mutants [--seed S]
#       Builds both deliberately broken servers into target/mutants and asserts that the chaos
#       scenario aimed at each FAILS: mutant-ack-before-fsync (the Raft log acknowledged before
#       fsync) under power loss, mutant-local-linearizable (linearizable lookups from local
#       state) under leader isolation. Each gets up to 3 attempts with seeds S, S+1, S+2.
#
# Every run prints its seed; a failed run prints the directory holding its history, checker
# report, node logs and data dirs. Output is also kept in target/chaos/.
set -euo pipefail

minutes=""
seed=""
scenario=""
mutants=0
keep_going=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --minutes) minutes="$2"; shift 2 ;;
        --seed) seed="$2"; shift 2 ;;
        --scenario) scenario="$2"; shift 2 ;;
        --mutants) mutants=1; shift ;;
        --keep-going) keep_going=1; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "chaos.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ -z "$seed" ]]; then
    seed=$(( (RANDOM << 30) ^ (RANDOM << 15) ^ RANDOM ))
fi
if [[ $mutants -eq 0 && -z "$minutes" ]]; then
    echo "chaos.sh: give --minutes N (a soak) or --mutants" >&2
    exit 2
fi

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
mkdir -p target/chaos
stamp="$(date +%Y%m%d-%H%M%S)"

run_soak() {
    local log="target/chaos/soak-$stamp.log"
    echo "chaos.sh: soak of $minutes minutes, seed $seed${scenario:+, scenario $scenario}; output in $log"
    echo "chaos.sh: server binary ${LOGDEX_BIN:-target/debug/logdex}"
    cargo build -p logdex-api
    cargo test -p logdex-cluster-tests --test chaos_soak --no-run
    local bound=$(( minutes * 60 + 900 ))
    LOGDEX_CHAOS_MINUTES="$minutes" LOGDEX_CHAOS_SEED="$seed" LOGDEX_CHAOS_SCENARIO="$scenario" \
        LOGDEX_CHAOS_KEEP_GOING="$keep_going" \
        timeout "$bound" cargo test -p logdex-cluster-tests --test chaos_soak -- --nocapture 2>&1 \
        | grep --line-buffered -v '^20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]T' >"$log" || true
    grep -E '^\[soak\]|PASSED in|FAILED in' "$log" || true
    if grep -q "test result: ok" "$log"; then
        echo "chaos.sh: soak PASSED: $(grep -c 'PASSED in' "$log") rounds (seed $seed, $minutes minutes)"
        return 0
    fi
    echo "chaos.sh: soak FAILED (seed $seed); see $log and the kept directory it names" >&2
    return 1
}

# mutant feature, test file, test name
mutant_targets=(
    "mutant-ack-before-fsync chaos_crash chaos_power_loss_of_all_nodes"
    "mutant-local-linearizable chaos_network chaos_isolate_the_leader"
)

run_mutants() {
    local survived=0
    cargo test -p logdex-cluster-tests --tests --no-run
    for target in "${mutant_targets[@]}"; do
        read -r feature file test <<<"$target"
        echo "chaos.sh: building $feature into target/mutants"
        CARGO_TARGET_DIR=target/mutants cargo build -p logdex-api --features "$feature"
        cp target/mutants/debug/logdex "target/mutants/logdex-$feature"
        local killed=0
        for attempt in 0 1 2; do
            local s=$(( seed + attempt ))
            local log="target/chaos/$feature-$stamp-$attempt.log"
            echo "chaos.sh: $feature, attempt $attempt: $test with seed $s (output in $log)"
            if LOGDEX_BIN="$root/target/mutants/logdex-$feature" LOGDEX_CHAOS_SEED="$s" \
                timeout 600 cargo test -p logdex-cluster-tests --test "$file" "$test" -- --nocapture 2>&1 \
                | grep --line-buffered -v '^20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]T' >"$log"; then :; fi
            if grep -q "test result: ok" "$log"; then
                echo "chaos.sh: $feature survived attempt $attempt"
                continue
            fi
            killed=1
            if grep -q "CHECKER FAILED" "$log"; then
                echo "chaos.sh: $feature KILLED by the checkers:"
                grep -E "^C[1-5] .*violations|^  - " "$log" | head -8 | cut -c1-400
            else
                echo "chaos.sh: $feature KILLED (the run failed outside the checkers):"
                grep -E "FAILED in|^Error" "$log" | head -3 | cut -c1-600
            fi
            break
        done
        if [[ $killed -eq 0 ]]; then
            echo "chaos.sh: MUTANT SURVIVED: $feature passed $test three times" >&2
            survived=1
        fi
    done
    if [[ $survived -ne 0 ]]; then
        return 1
    fi
    echo "chaos.sh: every mutant was killed"
}

if [[ $mutants -eq 1 ]]; then
    run_mutants
else
    run_soak
fi
