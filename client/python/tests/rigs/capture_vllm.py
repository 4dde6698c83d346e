"""Captures a real vLLM's KV-event wire traffic as golden test data:

    KVCM_VLLM_PYTHON=/path/to/vllm-venv/bin/python python -m rigs.capture_vllm OUTDIR

(from client/python/tests, with kvcm installed).

Starts a VllmEngine with a small KV cache, subscribes a raw ZeroMQ SUB to its PUB endpoint,
runs a scripted workload (prompts sharing prefixes, enough distinct prompts to evict, salted
requests, reset_prefix_cache and one more request) and finally asks the replay endpoint for
everything from seq 0 with a raw DEALER. Writes OUTDIR/capture.json:

    {"vllm_version": "0.32.0", "block_size": 32, "num_blocks": N,
     "kv_events_config": {...},            # as given to --kv-events-config
     "steps": [{"step": i, "kind": "completion", "prompt": [ids], "cache_salt": str|null,
                "prompt_tokens": n, "cached_tokens": n},
               {"step": i, "kind": "reset_prefix_cache"},
               {"step": i, "kind": "replay", "start_seq": n}],  # from 0, 5 and 1000
     "frames": [{"socket": "sub" | "dealer_send" | "dealer_recv", "after_step": i,
                 "parts": [hex of each frame part]}]}   # in the order sent or received

A frame's `after_step` is the step whose request (or replay) preceded it. The payloads are
vLLM's msgpack KVEventBatch; nothing is decoded here. vLLM publishes a step's events with the
next engine step: the AllBlocksCleared of reset_prefix_cache comes with the next request.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from rigs.vllm_engine import BLOCK_SIZE, VllmEngine

NUM_BLOCKS = 24
END_OF_REPLAY_WAIT_S = 10.0


def tokens(seed: int, n: int) -> list[int]:
    """n word-token ids (0..999) of one seed."""
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


def workload() -> list[dict[str, Any]]:
    """The scripted steps; completion steps send prompts of whole blocks plus 5 tokens."""
    a = tokens(1, 3 * BLOCK_SIZE + 5)
    b = a[:2 * BLOCK_SIZE] + tokens(2, BLOCK_SIZE + 5)  # shares 2 blocks with a
    steps: list[dict[str, Any]] = [
        {"kind": "completion", "prompt": a},
        {"kind": "completion", "prompt": b},
        {"kind": "completion", "prompt": a},                      # a hit of 3 blocks
        {"kind": "completion", "prompt": a, "cache_salt": "salt-1"},  # salted: no hit
        {"kind": "completion", "prompt": a, "cache_salt": "salt-1"},  # its own hit
    ]
    # 8 distinct prompts of 4 blocks: 32 blocks through a cache of NUM_BLOCKS: evictions.
    steps += [{"kind": "completion", "prompt": tokens(10 + i, 4 * BLOCK_SIZE + 5)}
              for i in range(8)]
    steps += [{"kind": "completion", "prompt": a},                # evicted by now
              {"kind": "reset_prefix_cache"},
              {"kind": "completion", "prompt": b},               # publishes the clear
              {"kind": "replay", "start_seq": 0},
              {"kind": "replay", "start_seq": 5},
              {"kind": "replay", "start_seq": 1000}]              # beyond the last seq
    return steps


class Recorder:
    def __init__(self, engine: VllmEngine):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(engine.pub_endpoint)
        self.replay_endpoint = engine.replay_endpoint
        self.frames: list[dict[str, Any]] = []
        self.step = -1

    def record(self, socket: str, parts: list[bytes]) -> None:
        self.frames.append({"socket": socket, "after_step": self.step,
                            "parts": [p.hex() for p in parts]})

    def drain_sub(self, quiet_s: float = 0.5) -> None:
        """Records live frames until none came for quiet_s."""
        while self.sub.poll(int(quiet_s * 1000)):
            self.record("sub", self.sub.recv_multipart())

    def replay(self, start_seq: int) -> None:
        """One replay request; records its answers up to the end marker (seq -1)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        request = [b"", start_seq.to_bytes(8, "big")]
        dealer.send_multipart(request)
        self.record("dealer_send", request)
        deadline = time.monotonic() + END_OF_REPLAY_WAIT_S
        while time.monotonic() < deadline:
            if not dealer.poll(500):
                continue
            parts = dealer.recv_multipart()
            self.record("dealer_recv", parts)
            if any(p == (-1).to_bytes(8, "big", signed=True) for p in parts):
                break
        else:
            raise RuntimeError(f"no end of replay within {END_OF_REPLAY_WAIT_S} s")
        dealer.close()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def capture(engine: VllmEngine) -> dict[str, Any]:
    """Runs the workload on a started engine; the capture as a JSON-ready dict."""
    rec = Recorder(engine)
    time.sleep(1.0)  # the SUB's subscription reaches the publisher (slow joiner)
    steps = workload()
    try:
        for i, step in enumerate(steps):
            rec.step = step["step"] = i
            if step["kind"] == "completion":
                step.setdefault("cache_salt", None)
                body = engine.complete(step["prompt"], cache_salt=step["cache_salt"])
                usage = body["usage"]
                step["prompt_tokens"] = usage["prompt_tokens"]
                step["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens") or 0
            elif step["kind"] == "reset_prefix_cache":
                engine.reset_prefix_cache()
            else:
                rec.drain_sub()
                rec.replay(step["start_seq"])
            rec.drain_sub()
    finally:
        rec.close()
    return {"vllm_version": engine_version(engine.python), "block_size": BLOCK_SIZE,
            "num_blocks": engine.num_blocks, "kv_events_config": engine.kv_events_config(),
            "steps": steps, "frames": rec.frames}


def engine_version(python: str) -> str:
    """vllm.__version__ in the environment of `python`."""
    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                          check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rigs.capture_vllm OUTDIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvcm-capture-") as work:
        engine = VllmEngine(work, num_blocks=NUM_BLOCKS)
        try:
            engine.start()
            result = capture(engine)
        except BaseException:
            print(engine.log_tail(), file=sys.stderr)
            raise
        finally:
            engine.stop()
    path = out / "capture.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{path}: {len(result['frames'])} frames, {len(result['steps'])} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
