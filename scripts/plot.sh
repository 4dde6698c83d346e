#!/usr/bin/env bash
# Runs scripts/plot_hit_rate.py (kvcm-bench's CSV → hit-rate plot) with matplotlib, which it
# installs the first time into a virtual environment of its own (KVCM_PLOT_VENV, default
# build/plot-venv of this checkout; PyPI or a pip cache that holds matplotlib).
#   scripts/plot.sh g1.csv -o hit_rate.png     # arguments go to plot_hit_rate.py
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${KVCM_PLOT_VENV:-$root/build/plot-venv}
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if ! "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
  echo "plot.sh: installing matplotlib into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check matplotlib
fi
flock -u 9
exec "$venv/bin/python" "$root/scripts/plot_hit_rate.py" "$@"
