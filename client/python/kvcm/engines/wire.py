"""The frames of vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py), every release, and
of SGLang's, which speaks vLLM >= 0.26's form (sglang/srt/disaggregation/kv_events.py, 0.5.23).

Live (PUB), all releases:      [topic, seq, payload]    (0.9.2 - 0.33.0 checked)
Replay answer (ROUTER -> our DEALER, after the empty delimiter frame):
  vLLM <= 0.25:                [b"", seq, payload]           end: [b"", -1, b""]
  vLLM >= 0.26:                [b"", topic, seq, payload]    end: [b"", b"", -1, b""]
seq is 8 bytes big-endian (-1 signed for the end marker). docs/ENGINES.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class FrameError(ValueError):
    """A message that is none of the forms above."""


@dataclass(frozen=True)
class ReplayFrame:
    """One replay answer: a batch (seq >= 0), or the end marker (seq None)."""
    seq: int | None
    payload: bytes
    # "seq" (vLLM <= 0.25) or "topic" (>= 0.26): which form the publisher speaks.
    form: str


def parse_live(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of a live message."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise FrameError(f"a live message of {len(frames)} frames is not [topic, seq, payload]")
    return int.from_bytes(frames[1], "big"), frames[2]


def parse_replay(frames: list[bytes]) -> ReplayFrame:
    """A replay answer as the DEALER receives it (the delimiter frame first)."""
    if len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8:
        seq_b, payload, form = frames[1], frames[2], "seq"
    elif len(frames) == 4 and frames[0] == b"" and len(frames[2]) == 8:
        seq_b, payload, form = frames[2], frames[3], "topic"
    else:
        raise FrameError(f"a replay answer of {len(frames)} frames is neither [b'', seq, "
                         "payload] nor [b'', topic, seq, payload]")
    if seq_b == END_SEQ:
        return ReplayFrame(None, b"", form)
    return ReplayFrame(int.from_bytes(seq_b, "big"), payload, form)


def replay_request(start_seq: int) -> tuple[bytes, bytes]:
    """What the DEALER sends: vLLM's ROUTER reads [identity, b"", start_seq]."""
    return b"", start_seq.to_bytes(8, "big")
