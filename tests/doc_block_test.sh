#!/usr/bin/env bash
# Runs one documentation command block as written: the block after
# "<!-- kvcm-doc: id=NAME -->" in FILE (tests/doc_blocks.py extract), with bash -euo pipefail,
# in a scratch copy of what a reader has after the quick start: a directory whose entries
# link to the source tree's, with build/test the build directory and build/release its
# server, client and gpu directories (what scripts/run.sh builds), so that the block's own
# relative paths are the ones tested. PORT is a free loopback port (blocks default to a fixed
# one). Fails when the block fails or runs longer than $DEMO_TIMEOUT_S seconds (default 120);
# prints the scratch directory's *.log files then.
#   tests/doc_block_test.sh [--needs=WHAT]... FILE NAME BUILD_DIR
# WHAT (each skips, exit 77, when missing unless its KVCM_REQUIRE_* is 1, as under
# scripts/test.sh):
#   python          BUILD_DIR/pyenv (PyPI or a warm pip cache)      KVCM_REQUIRE_PYTHON
#   vllm            BUILD_DIR/vllm-venv (scripts/vllm_env.sh)       KVCM_REQUIRE_VLLM
#   sglang          BUILD_DIR/sglang-venv (scripts/sglang_env.sh)   KVCM_REQUIRE_SGLANG
#   k8s             kubectl in BUILD_DIR/k8s-venv, put on PATH      KVCM_REQUIRE_K8S
#   run-manager     the manager scripts/run.sh starts: 127.0.0.1:50051, metrics :9464, dev
#                   mode (skips when another process holds either port)
#   bench           BUILD_DIR/bench/kvcm-bench (KVCM_BUILD_BENCH)
#   fuzz            the source tree's build/fuzz (scripts/fuzz.sh, after ctest in test.sh),
#                   linked as build/fuzz; fuzz/ is a copy, for blocks that write into it
# With --elsewhere the block runs as README's walkthroughs advise: from an empty scratch
# folder, with REPO, B, VLLM and SGLANG naming the copy absolutely; it then fails if the
# block wrote anything into the copy (a token, a key or a log left in the user's clone).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
needs=()
elsewhere=false
while [[ ${1:-} == --* ]]; do
  case $1 in
    --needs=*) needs+=("${1#--needs=}") ;;
    --elsewhere) elsewhere=true ;;
    *) echo "doc_block_test: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
file=$1 name=$2 build=$(cd "$3" && pwd)
repo=$(cd "$here/.." && pwd)

skip_or_fail() {  # skip_or_fail REQUIRE_VAR MESSAGE
  if [ "${!1:-0}" = 1 ]; then echo "FAIL: $name: $2" >&2; exit 1; fi
  echo "SKIP: $name: $2"
  exit 77
}
run_manager=false
for need in "${needs[@]}"; do
  case $need in
    python) [ -x "$build/pyenv/bin/python" ] ||
      skip_or_fail KVCM_REQUIRE_PYTHON "no Python environment at $build/pyenv" ;;
    vllm) [ -x "$build/vllm-venv/bin/python" ] ||
      skip_or_fail KVCM_REQUIRE_VLLM "no vLLM environment at $build/vllm-venv" ;;
    sglang) [ -x "$build/sglang-venv/bin/python" ] ||
      skip_or_fail KVCM_REQUIRE_SGLANG "no SGLang environment at $build/sglang-venv" ;;
    k8s) [ -x "$build/k8s-venv/bin/kubectl" ] ||
      skip_or_fail KVCM_REQUIRE_K8S "no kubectl in $build/k8s-venv (scripts/k8s_env.sh)"
      PATH="$build/k8s-venv/bin:$PATH" ;;
    bench) [ -x "$build/bench/kvcm-bench" ] || skip_or_fail KVCM_REQUIRE_BENCH \
      "no $build/bench/kvcm-bench (configure with -DKVCM_BUILD_BENCH=ON)" ;;
    fuzz) [ -x "$repo/build/fuzz/fuzz/cache_manager_fuzzer" ] ||
      skip_or_fail KVCM_REQUIRE_FUZZ "no fuzzers in $repo/build/fuzz (scripts/fuzz.sh)" ;;
    run-manager) run_manager=true ;;
    *) echo "doc_block_test: unknown --needs=$need" >&2; exit 2 ;;
  esac
done

block=$(python3 "$here/doc_blocks.py" --root "$repo" extract "$file" "$name")
scratch=$(mktemp -d)
set -m  # the block and the manager in process groups of their own, killed whole at the end
groups=()
cleanup() {
  for g in "${groups[@]}"; do
    kill -KILL -- "-$g" 2>/dev/null || true
    wait "$g" 2>/dev/null || true
  done
  if [ "${KVCM_DOC_KEEP:-0}" = 1 ]; then
    echo "kept $scratch ${work:-}"
  else
    rm -rf "$scratch" ${work:+"$work"}
  fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # (ctest's own timeout) so that cleanup runs

for entry in "$repo"/* "$repo"/.[!.]*; do
  [ -e "$entry" ] && [ "$(basename "$entry")" != build ] && ln -s "$entry" "$scratch/"
done
mkdir -p "$scratch/build/release"
ln -s "$build" "$scratch/build/test"
for d in server client gpu; do ln -s "$build/$d" "$scratch/build/release/$d"; done
if [[ " ${needs[*]} " == *" fuzz "* ]]; then
  ln -s "$repo/build/fuzz" "$scratch/build/fuzz"
  rm "$scratch/fuzz" && cp -r "$repo/fuzz" "$scratch/fuzz"
fi
cd "$scratch"
printf '%s\n' "$block" > "$scratch/.block.sh"

if $run_manager; then
  if ! python3 - <<'EOF'
import socket, sys
for port in (50051, 9464):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        sys.exit(1)
    finally:
        s.close()
EOF
  then
    echo "SKIP: $name: port 50051 or 9464 is taken; this block talks to the manager that" \
      "./scripts/run.sh serves there"
    exit 77
  fi
  build/release/server/kvcm-manager --insecure > manager.log 2>&1 &
  groups+=($!)
  until build/release/client/kvcmctl --insecure --deadline_ms=500 stats > /dev/null 2>&1; do
    kill -0 "${groups[-1]}" 2>/dev/null || { cat manager.log; exit 1; }
    sleep 0.1
  done
fi

if $elsewhere; then
  before=$(ls -A "$scratch")
  work=$(mktemp -d)
  cd "$work"
  export REPO=$scratch B=$scratch/build/release VLLM=$scratch/build/test/vllm-venv \
    SGLANG=$scratch/build/test/sglang-venv
fi
port=$(python3 "$here/free_port.py")
PORT=$port bash -euo pipefail "$scratch/.block.sh" &
block_pid=$!
groups+=($block_pid)
( sleep "${DEMO_TIMEOUT_S:-120}"; echo "doc_block_test: $name: timed out" >&2
  kill -TERM -- "-$block_pid" 2>/dev/null; sleep 5; kill -KILL -- "-$block_pid" 2>/dev/null ) &
groups+=($!)
status=0
wait $block_pid || status=$?
if [ $status != 0 ]; then
  for log in *.log; do [ -f "$log" ] && { echo "--- $log ---"; tail -n 100 "$log"; }; done
  echo "FAIL: $file, block $name: exit status $status" >&2
  exit $status
fi
if $elsewhere && [ "$(ls -A "$scratch")" != "$before" ]; then
  echo "FAIL: $file, block $name, run from a scratch folder, wrote into the repository:" >&2
  comm -13 <(printf '%s\n' "$before") <(ls -A "$scratch") >&2
  exit 1
fi
