#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/; clang, ASan + UBSan) and runs each for a bounded
# time, first over its regression inputs (fuzz/regressions/<harness>/), then fuzzing from
# its checked-in seed corpus (fuzz/corpus/<harness>/). Fails on any crash, sanitizer report,
# leak, timeout or out-of-memory; the input that did it is under $FUZZ_OUT/crashes/.
#   ./scripts/fuzz.sh            # 10 s per harness
#   ./scripts/fuzz.sh 300        # 5 min per harness
#   ./scripts/fuzz.sh --build    # only build them (scripts/test.sh, on idle CPU, during ctest)
# Environment: BUILD_DIR (default build/fuzz), JOBS (default: nproc), FUZZERS (default:
# every harness), FUZZ_OUT (new corpus entries, crashes and logs; default $BUILD_DIR/runs),
# RSS_LIMIT_MB (default 2048).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-10}
build_only=0
[ "$seconds" = --build ] && build_only=1
build_dir=${BUILD_DIR:-build/fuzz}
jobs=${JOBS:-$(nproc)}
out=${FUZZ_OUT:-$build_dir/runs}
rss_limit_mb=${RSS_LIMIT_MB:-2048}
fuzzers=${FUZZERS:-"cache_manager_fuzzer agent_control_fuzzer block_agent_fuzzer data_port_fuzzer trace_fuzzer page_hash_fuzzer"}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

# Its own build directory: every object carries the sanitizers and libFuzzer's coverage.
cmake -S . -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DKVCM_ENABLE_CUDA=OFF \
  -DKVCM_BUILD_TESTS=OFF \
  -DKVCM_BUILD_BENCH=ON \
  -DKVCM_BUILD_FUZZERS=ON >/dev/null
cmake --build "$build_dir" --target kvcm_fuzzers -j "$jobs"
[ "$build_only" = 1 ] && exit 0

mkdir -p "$out/crashes"
summary=()
for f in $fuzzers; do
  bin=$build_dir/fuzz/$f
  if compgen -G "fuzz/regressions/$f/*" >/dev/null; then
    "$bin" -rss_limit_mb="$rss_limit_mb" -timeout=10 fuzz/regressions/"$f"/* \
      >"$out/$f.regressions.log" 2>&1 || {
      cat "$out/$f.regressions.log"
      echo "fuzz: $f failed on a regression input" >&2
      exit 1
    }
  fi
  mkdir -p "$out/corpus/$f"
  log=$out/$f.log
  # New entries go to the first directory, never into the checked-in seeds.
  if ! "$bin" -max_total_time="$seconds" -rss_limit_mb="$rss_limit_mb" -timeout=10 \
    -max_len=8192 -print_final_stats=1 -artifact_prefix="$out/crashes/$f-" \
    "$out/corpus/$f" "fuzz/corpus/$f" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz: $f crashed; input under $out/crashes/ (log $log)" >&2
    exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  corpus=$(grep -E '^#[0-9]+' "$log" | tail -n 1 | sed -n 's/.*corp: \([0-9]*\)\/.*/\1/p')
  secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log")
  summary+=("$(printf '%-22s %10s execs %5s s  corpus %5s  crashes 0' "$f" "$execs" "$secs" "$corpus")")
done
printf '%s\n' "${summary[@]}"
