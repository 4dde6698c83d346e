"""PublishSession: sessions, sequences, chunking, heartbeats and error handling."""

from kvcm.engines.mirror import Change, ChangeKind, Tier
from kvcm.engines.session import Action, PublishSession, SessionOptions, State, classify

STORED, REMOVED = ChangeKind.STORED, ChangeKind.REMOVED


def ch(pages, kind=STORED, tier=Tier.GPU, tag=1):
    return Change(kind, tier, bytes([tag]) * (16 * pages))


def test_session_starts_at_one_with_the_snapshot_then_follows():
    s = PublishSession(SessionOptions(heartbeat_interval_s=10))
    assert s.next_request(0.0) is None  # nothing before open()
    s.open([ch(2)])
    r = s.next_request(0.0)
    assert (r.sequence, r.changes, r.close) == (1, (ch(2),), False) and r.session != 0
    assert s.next_request(0.0) is r  # in flight until it succeeds: a retry resends it
    s.on_sent(0.0)
    assert s.next_request(1.0) is None
    s.add([ch(1, REMOVED)])
    r2 = s.next_request(1.0)
    assert (r2.session, r2.sequence) == (r.session, 2)
    s.on_sent(1.0)
    first = r.session
    s.open([])  # a new session even when there is nothing to say: seq 1 empties the pools
    r3 = s.next_request(1.0)
    assert r3.sequence == 1 and r3.changes == () and r3.session != first


def test_empty_session_opening_is_not_a_heartbeat():
    s = PublishSession()
    s.open([])
    s.next_request(0.0)
    assert s.counters.heartbeats == 1  # an empty request
    s.on_sent(0.0)
    assert s.counters.sessions == 1


def test_heartbeat_after_the_interval():
    s = PublishSession(SessionOptions(heartbeat_interval_s=10))
    s.open([ch(1)])
    s.next_request(0.0)
    s.on_sent(0.0)
    assert s.next_request(9.9) is None
    hb = s.next_request(10.0)
    assert hb.changes == () and hb.sequence == 2 and s.counters.heartbeats == 1


def test_chunks_by_bytes_and_by_count():
    s = PublishSession(SessionOptions(max_request_bytes=100 * 16, max_changes=3))
    s.open([ch(60), ch(30), ch(20), ch(1), ch(1), ch(1), ch(500)])
    sizes = []
    while (r := s.next_request(0.0)) is not None and r.changes:
        sizes.append([c.num_pages for c in r.changes])
        s.on_sent(0.0)
    # 60+30 fit, +20 would not; then three by count; an oversized chain goes alone.
    assert sizes == [[60, 30], [20, 1, 1], [1], [500]]
    assert s.outbox_pages == 0


def test_long_chains_are_cut_or_dropped():
    s = PublishSession(SessionOptions(max_chain_pages=10))
    s.open([ch(12), ch(12, REMOVED), ch(10, REMOVED)])
    r = s.next_request(0.0)
    assert [(c.kind, c.num_pages) for c in r.changes] == [(STORED, 10), (REMOVED, 10)]
    assert s.counters.truncated_chains == 1 and s.counters.dropped_changes == 1


def test_overflow_drops_the_outbox():
    s = PublishSession(SessionOptions(max_outbox_pages=100))
    s.open([ch(60)])
    s.add([ch(60)])
    assert s.overflowed and s.state is State.IDLE and s.next_request(0.0) is None


def test_suspend_and_close():
    s = PublishSession()
    s.add([ch(1)])
    assert s.next_request(0.0) is None  # not open: dropped
    s.open([ch(1)])
    s.next_request(0.0)
    s.on_sent(0.0)
    session = s.session
    s.suspend()
    s.add([ch(1)])
    assert s.next_request(100.0) is None
    s.close()  # the manager still has the session: end it explicitly
    r = s.next_request(100.0)
    assert (r.session, r.sequence, r.close, r.changes) == (session, 2, True, ())
    s.on_sent(100.0)
    assert s.state is State.IDLE and s.next_request(200.0) is None
    s.close()  # nothing to close any more
    assert s.next_request(200.0) is None


def test_failed_close_is_given_up_unless_transient():
    s = PublishSession()
    s.open([])
    s.next_request(0.0)
    s.on_sent(0.0)
    s.close()
    s.next_request(0.0)
    assert s.on_failed("UNAVAILABLE", "") is Action.RETRY
    assert s.next_request(0.0).close
    assert s.on_failed("FAILED_PRECONDITION", "unknown session: sequence 2") is \
        Action.NEW_SESSION
    assert s.state is State.IDLE and s.next_request(0.0) is None
    assert s.counters.errors == {"UNAVAILABLE": 1, "FAILED_PRECONDITION": 1}


def test_classify():
    assert classify("UNAVAILABLE", "") is Action.RETRY
    assert classify("DEADLINE_EXCEEDED", "") is Action.RETRY
    assert classify("RESOURCE_EXHAUSTED", "") is Action.RETRY
    assert classify("FAILED_PRECONDITION", "sequence 5 expected 3") is Action.NEW_SESSION
    assert classify("FAILED_PRECONDITION", "key_fingerprint 12 is not the namespace key's") \
        is Action.REREGISTER
    assert classify("NOT_FOUND", "namespace acme/m") is Action.REREGISTER
    assert classify("UNAUTHENTICATED", "") is Action.AUTH
    assert classify("PERMISSION_DENIED", "") is Action.AUTH
    assert classify("INVALID_ARGUMENT", "engine_id") is Action.REFUSED
    assert classify("UNIMPLEMENTED", "") is Action.REFUSED
