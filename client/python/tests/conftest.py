"""Fixtures: a real kvcm-manager process on a loopback port, and test helpers.

The manager binary comes from $KVCM_MANAGER_BIN. Without it the tests that need a manager
skip, unless $KVCM_REQUIRE_PYTHON=1 (set by scripts/test.sh): then they fail.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

import kvcm
import rigs.manager

HERE = Path(__file__).resolve().parent
REPO_ROOT = Path(os.environ.get("KVCM_SOURCE_ROOT") or HERE.parent.parent.parent).resolve()

_source_package = HERE.parent / "kvcm"
if (
    Path(kvcm.__file__).resolve().parent == _source_package
    and not (_source_package / "_proto").exists()
):
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


def free_port() -> int:
    return rigs.manager.free_port()


def binary(env: str, what: str) -> str:
    """The path in $env, or skip (fail under KVCM_REQUIRE_PYTHON=1)."""
    path = os.environ.get(env, "")
    if not path or not os.access(path, os.X_OK):
        require_or_skip(f"${env} does not name the {what} binary ({path!r})")
    return path


def engine_test_path(engine: str, env: str, what: str) -> str:
    """The executable in $env for a real-engine test ("VLLM", "SGLANG"), or skip (fail under
    KVCM_REQUIRE_<engine>=1 or KVCM_REQUIRE_PYTHON=1)."""
    path = os.environ.get(env, "")
    if path and os.access(path, os.X_OK):
        return path
    reason = f"${env} does not name {what} ({path!r})"
    if os.environ.get(f"KVCM_REQUIRE_{engine}") == "1" or required():
        pytest.fail(f"{reason} (KVCM_REQUIRE_{engine}/KVCM_REQUIRE_PYTHON=1)")
    pytest.skip(reason)


def vllm_test_path(env: str, what: str) -> str:
    return engine_test_path("VLLM", env, what)


def sglang_test_path(env: str, what: str) -> str:
    return engine_test_path("SGLANG", env, what)


def kvcm_pythonpath(workdir: Path) -> Path:
    """workdir/pythonpath holding only a symlink to the kvcm package under test: an engine's
    PYTHONPATH (kvcm's stubs load with the engine's newer protobuf, and nothing else of this
    environment shadows the engine's own packages)."""
    pythonpath = workdir / "pythonpath"
    pythonpath.mkdir(exist_ok=True)
    if not (pythonpath / "kvcm").exists():
        (pythonpath / "kvcm").symlink_to(Path(kvcm.__file__).parent)
    return pythonpath


def wait_registered(client: "kvcm.Client", agents: Dict[str, "Process"],
                    timeout_s: float = 20) -> None:
    """Until every agent (id -> its process) is registered and alive at the manager."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {a.agent_id for a in client.stats().agents if a.alive}
        if alive >= set(agents):
            return
        for agent_id, p in agents.items():
            assert p.proc.poll() is None, p.log.read_text()
        assert time.monotonic() < deadline, f"agents {sorted(set(agents) - alive)} did not register"
        time.sleep(0.1)


class Process:
    """A child process whose output goes to a log file; stopped by stop() or kill()."""

    def __init__(self, args: List[str], log: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.args = args
        self.log = log
        self._file = open(log, "ab")
        self.proc = subprocess.Popen(
            args, stdout=self._file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_for_log(self, text: str, timeout_s: float = 15.0) -> str:
        """Waits until the log has a line containing `text`; returns that line."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for line in self.log.read_text(errors="replace").splitlines():
                if text in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(
            f"{self.args[0]} did not log {text!r} (exit {self.proc.poll()}):\n"
            + self.log.read_text(errors="replace")
        )

    def status(self, field: str) -> int:
        """A size field of /proc/<pid>/status (VmRSS, VmHWM), in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._file.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._file.close()


class Manager:
    """A kvcm-manager on 127.0.0.1:port; restart() brings it back on the same port."""

    def __init__(self, binary_path: str, workdir: Path, args: List[str], secret_hex: str) -> None:
        self.binary = binary_path
        self.workdir = workdir
        self.args = args
        self.secret_hex = secret_hex
        self.port = free_port()
        self.process: Optional[Process] = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, secret_hex: Optional[str] = None) -> "Manager":
        if secret_hex is not None:
            self.secret_hex = secret_hex
        self.starts += 1
        env = dict(os.environ, KVCM_HASH_SECRET_HEX=self.secret_hex)
        self.process = Process(
            [
                self.binary,
                f"--listen_address={self.address}",
                "--metrics_address=",
                "--shutdown_grace_ms=100",
                *self.args,
            ],
            self.workdir / f"manager{self.starts}.log",
            env,
        )
        self.process.wait_for_log("kvcm-manager listening on")
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def restart(self, secret_hex: Optional[str] = None) -> None:
        self.kill()
        self.start(secret_hex)


def random_secret() -> str:
    return random.Random().randbytes(16).hex()


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvcm-pytest-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def manager_factory(workdir: Path) -> Iterator:
    """Makes (not starts) managers with extra flags; stops them after the test."""
    made: List[Manager] = []
    path = binary("KVCM_MANAGER_BIN", "kvcm-manager")

    def make(*args: str, secret_hex: Optional[str] = None, insecure: bool = True) -> Manager:
        flags = ["--insecure", *args] if insecure else list(args)
        m = Manager(path, workdir, flags, secret_hex or random_secret())
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


@pytest.fixture
def manager(manager_factory) -> Manager:
    """A plaintext manager with index-only pools (no agents)."""
    return manager_factory().start()


@pytest.fixture
def client(manager: Manager) -> Iterator[kvcm.Client]:
    with kvcm.Client(manager.address, insecure=True) as c:
        yield c


def scrape_metric(address: str, name: str) -> float:
    """A Prometheus metric at http://address/metrics (a manager's or an agent's
    --metrics_address), summed over its label sets; 0 when absent."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)


def prompt(n: int, seed: int = 7) -> List[int]:
    """n pseudo-random token ids."""
    rng = random.Random(seed)
    return [rng.randrange(128000) for _ in range(n)]
