"""vLLM's publisher frames, both replay forms (kvcm.engines.wire)."""

import pytest

from kvcm.engines.wire import END_SEQ, FrameError, parse_live, parse_replay, replay_request

SEQ7 = (7).to_bytes(8, "big")


def test_live_form():
    assert parse_live([b"topic", SEQ7, b"payload"]) == (7, b"payload")
    with pytest.raises(FrameError):
        parse_live([SEQ7, b"payload"])


def test_replay_until_0_25():
    r = parse_replay([b"", SEQ7, b"payload"])
    assert (r.seq, r.payload, r.form) == (7, b"payload", "seq")
    assert parse_replay([b"", END_SEQ, b""]).seq is None


def test_replay_from_0_26_carries_the_topic():
    r = parse_replay([b"", b"kv", SEQ7, b"payload"])
    assert (r.seq, r.payload, r.form) == (7, b"payload", "topic")
    end = parse_replay([b"", b"", END_SEQ, b""])
    assert end.seq is None and end.form == "topic"


@pytest.mark.parametrize("frames", [[SEQ7, b"p"], [b"x", SEQ7, b"p"], [b"", b"t", b"123", b"p"],
                                    [b"", b"t", SEQ7, b"p", b"more"]])
def test_other_shapes_are_refused(frames):
    with pytest.raises(FrameError):
        parse_replay(frames)


def test_request():
    assert replay_request(5) == (b"", (5).to_bytes(8, "big"))
