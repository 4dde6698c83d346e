"""Drives rigs/sglang_publisher.py (SGLang's own radix cache and ZMQ publisher, run by
SGLang's Python) from a test, and captures its wire traffic as golden test data:

    python -m rigs.sglang_source SGLANG_PYTHON OUT.json     # from client/python/tests

The capture holds the commands, SGLang's events as its structs encode to builtins, and every
live frame a SUB received (hex), for tests/test_sglang_events.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rigs.manager import free_port

_DRIVER = Path(__file__).with_name("sglang_publisher.py")


class SglangSource:
    """One SGLang publisher process: `command` sends a command and returns its answer."""

    def __init__(self, python: str, page_size: int, log: Path, dynamo: bool = False,
                 topic: str = "kv-events"):
        self.page_size, self.topic = page_size, topic
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._log = open(log, "ab")
        args = [python, str(_DRIVER), "--endpoint", self.endpoint, "--replay",
                self.replay_endpoint, "--topic", topic, "--page-size", str(page_size)]
        if dynamo:
            args.append("--dynamo")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)
        first = self._read(timeout_s=240)
        assert first.get("ready"), first

    def _read(self, timeout_s: float = 60) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the SGLang publisher exited ({self.proc.poll()}); see "
                               f"{self._log.name}")
        return json.loads(line)

    def command(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("quit")
            except (RuntimeError, BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


def capture_workload(page_size: int) -> list[dict[str, Any]]:
    a = tokens(1, 6 * page_size)
    b = a[:2 * page_size] + tokens(2, 3 * page_size)
    return [{"op": "insert", "tokens": a}, {"op": "insert", "tokens": b},
            {"op": "insert", "tokens": a, "salt": "salt-1"},
            {"op": "insert", "tokens": [70000 + t for t in tokens(3, 2 * page_size)]},  # > u16
            {"op": "evict", "num_tokens": page_size}, {"op": "reset"},
            {"op": "insert", "tokens": tokens(4, 2 * page_size)}]


def capture(python: str, out: Path, page_size: int = 4) -> None:
    import zmq

    source = SglangSource(python, page_size, Path(tempfile.gettempdir()) / "sglang_source.log")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(source.endpoint)
    time.sleep(1.0)  # the slow joiner: a SUB misses what is sent before it is connected
    steps, frames = [], []
    try:
        for cmd in capture_workload(page_size):
            ans = source.command(**cmd)
            steps.append({**cmd, "events": ans.get("events", [])})
            while sub.poll(1000):
                frames.append({"after_step": len(steps) - 1,
                               "parts": [p.hex() for p in sub.recv_multipart()]})
    finally:
        source.close()
        sub.close(0)
        ctx.term()
    version = subprocess.run([python, "-c", "import importlib.metadata as m;"
                              "print(m.version('sglang'))"], capture_output=True, text=True,
                             check=True).stdout.strip()
    out.write_text(json.dumps({"sglang_version": version, "page_size": page_size,
                               "topic": source.topic, "steps": steps, "frames": frames},
                              indent=1) + "\n")


if __name__ == "__main__":
    capture(sys.argv[1], Path(sys.argv[2]))


class HeldBlocks:
    """What SGLang holds, from the events it published (as builtins): the oracle the bridge's
    mirror and the manager's pools are checked against."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def apply(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            tier = self.held.setdefault(e.get("medium") or "GPU", set())
            if e["type"] == "BlockStored":
                tier.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                tier.difference_update(e["block_hashes"])
            else:
                self.held.clear()

    def leading(self, block_hashes: list[int], medium: str = "GPU") -> int:
        """How many of a prompt's blocks, from the first, SGLang holds."""
        tier = self.held.get(medium, set())
        n = 0
        while n < len(block_hashes) and block_hashes[n] in tier:
            n += 1
        return n
