#!/usr/bin/env bash
# Every binary's --help and --version (issue 26): both exit 0; --help lists the binary's own
# flag (given as BINARY:FLAG; FLAG empty for a usage line only) and names no path of the
# machine that built it; --version prints "<name> <version> (git <rev>, <build type>)"; an
# unknown flag fails.
#
#   tests/program_flags_test.sh SOURCE_DIR BINARY:FLAG...
set -euo pipefail
source_dir=$(cd "$1" && pwd)
shift
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
for spec in "$@"; do
  binary=${spec%%:*}
  flag=${spec#*:}
  name=$(basename "$binary")
  out=$(timeout 30 "$binary" --help 2>&1) || fail "$name --help exited $?"
  if [[ -n $flag ]] && ! grep -q -- "$flag" <<<"$out"; then
    fail "$name --help does not list $flag"
  fi
  if grep -q -- "$source_dir" <<<"$out"; then
    fail "$name --help names the build machine's path $source_dir"
  fi
  version=$(timeout 30 "$binary" --version 2>&1) || fail "$name --version exited $?"
  if ! grep -Eq "^$name [0-9]+\.[0-9]+\.[0-9]+ \(git ([0-9a-f]{12}(-dirty)?|unknown), [A-Za-z]+\)$" \
    <<<"$version"; then
    fail "$name --version printed '$version'"
  fi
  if timeout 30 "$binary" --no_such_flag_kvcm >/dev/null 2>&1; then
    fail "$name accepted --no_such_flag_kvcm"
  fi
  echo "ok: $name"
done
if ((failures > 0)); then
  echo "$failures failure(s)" >&2
  exit 1
fi
