"""Fixtures: a real kvcm-manager process on a loopback port, and test helpers.

The manager binary comes from $KVCM_MANAGER_BIN. Without it the tests that need a manager
skip, unless $KVCM_REQUIRE_PYTHON=1 (set by scripts/test.sh): then they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvcm

HERE = Path(__file__).resolve().parent
REPO_ROOT = Path(os.environ.get("KVCM_SOURCE_ROOT") or HERE.parent.parent.parent).resolve()

_source_package = HERE.parent / "kvcm"
if Path(kvcm.__file__).resolve().parent == _source_package and not (
    _source_package / "_proto"
).exists():
    raise RuntimeError(
        f"the tests imported kvcm from the source tree ({_source_package}), which has no "
        "generated stubs: pip install ./client/python and run pytest from outside client/python"
    )


def required() -> bool:
    """Whether a missing prerequisite fails the tests instead of skipping them (CI)."""
    return os.environ.get("KVCM_REQUIRE_PYTHON") == "1"


def require_or_skip(reason: str) -> None:
    """Skips the calling test, or fails it when KVCM_REQUIRE_PYTHON=1."""
    if required():
        pytest.fail(f"{reason} (KVCM_REQUIRE_PYTHON=1)")
    pytest.skip(reason)
