"""bench/router_replay.py --smoke keeps working: every policy replays the trace's first
requests in one run, kv-aware through the real manager and the bridge's publish path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("numpy")
pytest.importorskip("kvcm.testing.fake_vllm")

from conftest import REPO_ROOT, binary, require_or_skip  # noqa: E402

TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def test_router_replay_smoke(tmp_path):
    manager = binary("KVCM_MANAGER_BIN", "kvcm-manager")
    if not TRACE.is_file():
        require_or_skip(f"no Mooncake trace at {TRACE}")
    out = tmp_path / "replay.json"
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "router_replay.py"), "--smoke",
         "--policies", "kv-aware,round-robin,consistent-hash,least-loaded",
         "--trace", str(TRACE), "--manager_bin", manager, "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    all_rows = json.loads(out.read_text())["rows"]
    rows = {r["policy"]: r for r in all_rows if not r.get("reference")}
    assert sorted(rows) == ["consistent-hash", "kv-aware", "least-loaded", "round-robin"]
    pooled = [r for r in all_rows if r.get("reference")]
    assert len(pooled) == 1 and pooled[0]["requests"] == rows["kv-aware"]["requests"]
    for row in rows.values():
        assert row["requests"] > 100 and 0.0 <= row["hit_rate"] < 1.0
        assert sum(row["per_engine"].values()) == row["requests"]
        assert row["imbalance_max_over_mean"] >= 1.0
    kv = rows["kv-aware"]
    assert "fallback" not in kv["reasons"], kv["reasons"]  # the manager ranked every request
    assert kv["expected_cached_tokens"] > 0
    # Routing by what the engines hold finds more of it than cache-blind rotation.
    assert kv["hit_rate"] > rows["round-robin"]["hit_rate"]
    assert "kv-aware" in run.stdout and "hit rate" in run.stdout
