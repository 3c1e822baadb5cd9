#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 60) each: `fuzz/run.sh 60`.
#
# cargo-fuzz (libFuzzer) on the stable toolchain: its `-Z` flags are allowed by
# RUSTC_BOOTSTRAP=1. Seeds come from corpus/<target>/ (committed, taken from the tests); what
# libFuzzer finds goes to .work/<target>/ and crashes to artifacts/<target>/ (both ignored).
# Exits non-zero on the first crash.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-60}"
export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
targets=$(cargo fuzz list)
# One build for every target before the clock starts.
cargo fuzz build
for target in $targets; do
  mkdir -p ".work/$target" "corpus/$target"
  echo "== fuzz $target for ${seconds}s"
  log=".work/$target.log"
  status=0
  cargo fuzz run "$target" ".work/$target" "corpus/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    >"$log" 2>&1 || status=$?
  grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|SUMMARY)|panicked' "$log" || true
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$log" >&2
    echo "fuzz: $target failed (exit $status); the input is under artifacts/$target/" >&2
    exit "$status"
  fi
done
echo "fuzz: every target ran ${seconds}s without a crash"
