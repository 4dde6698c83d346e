"""EventStream: vLLM batch sequencing, replay, resync and liveness, without sockets."""

from kvcm.engines.stream import EventStream, StreamOptions


class Sink:
    def __init__(self):
        self.calls = []
        self.applied = []

    def apply(self, seq, payload):
        self.calls.append(("apply", seq))
        if payload == b"bad":
            return False
        self.applied.append(seq)
        return True

    def request_replay(self, start):
        self.calls.append(("replay", start))

    def reset(self):
        self.calls.append(("reset",))
        self.applied = []

    def synced(self):
        self.calls.append(("synced",))

    def down(self):
        self.calls.append(("down",))

    def take(self):
        out, self.calls = self.calls, []
        return out


def started(**opts):
    sink = Sink()
    s = EventStream(sink, StreamOptions(**opts))
    s.start(0.0)
    assert sink.take() == [("replay", 0)]
    return s, sink


def replay(s, seqs, now=0.0, end=True):
    for q in seqs:
        s.on_replay(q, b"p%d" % q, now)
    if end:
        s.on_replay_end(now)


def test_first_sync_replays_the_buffer_then_follows_live():
    s, sink = started()
    s.on_live(3, b"p3", 0.1)          # arrives while the replay runs: kept
    replay(s, [0, 1, 2])
    assert sink.take() == [("apply", 0), ("apply", 1), ("apply", 2), ("synced",),
                           ("apply", 3)]
    s.on_live(4, b"p4", 0.2)
    assert sink.applied == [0, 1, 2, 3, 4] and s.up


def test_engine_that_buffered_nothing():
    s, sink = started()
    s.on_replay_end(0.0)
    assert sink.take() == [("synced",)]
    s.on_live(7, b"p7", 0.1)  # first batch we see: start there
    assert sink.applied == [7]


def test_gap_is_replayed():
    s, sink = started()
    replay(s, [0, 1])
    sink.take()
    s.on_live(4, b"p4", 1.0)
    assert sink.take() == [("replay", 2)] and s.counters.gaps == 1
    s.on_live(5, b"p5", 1.0)
    replay(s, [2, 3, 4, 5, 6], 1.1)  # 6 was published after live 5 arrived
    s.on_live(6, b"p6", 1.2)  # its live copy
    s.on_live(7, b"p7", 1.2)
    assert sink.applied == [0, 1, 2, 3, 4, 5, 6, 7]
    assert ("reset",) not in sink.take()


def test_gap_the_buffer_no_longer_covers_resyncs():
    s, sink = started()
    replay(s, [0, 1])
    s.on_live(9, b"p9", 1.0)
    sink.take()
    replay(s, [5], 1.1, end=False)  # 2..4 fell out of vLLM's buffer
    assert sink.take() == [("reset",), ("replay", 0)]
    replay(s, [5, 6, 7, 8, 9], 1.2)
    assert sink.take()[-1] == ("synced",)
    assert sink.applied == [5, 6, 7, 8, 9]
    assert s.counters.resyncs == 1 and s.counters.lost_batches == 3


def test_batch_published_after_the_replay_was_served():
    s, sink = started()
    replay(s, [0])
    s.on_live(3, b"p3", 1.0)
    replay(s, [1], 1.0)       # served before 2 existed; 2 was lost live
    assert sink.take()[-1] == ("replay", 2)
    replay(s, [2, 3], 1.1)
    assert sink.applied == [0, 1, 2, 3]


def test_empty_gap_replay_drops_live_batches_ahead_of_the_engine():
    s, sink = started()
    replay(s, [0])
    s.on_live(5, b"p5", 1.0)          # the engine holds nothing after 0: an earlier run's
    replay(s, [], 1.0)
    assert ("reset",) not in sink.take() and s.counters.stale_batches == 1
    s.on_live(1, b"p1", 1.1)          # not a restart: 5 is forgotten
    assert sink.applied == [0, 1] and s.counters.restarts == 0


def test_live_batch_ahead_after_a_resync_does_not_loop():
    s, sink = started(probe_interval_s=2.0, engine_timeout_s=30.0)
    replay(s, [0, 1, 2])
    s.on_reconnect(1.0)               # the engine restarted: full resync
    s.on_live(500, b"old", 1.0)       # still queued from its earlier run
    replay(s, [0], 1.1)
    for i in range(50):               # 10 s of answered probes and replays
        now = 1.2 + i * 0.2
        s.on_tick(now)
        if s._replay is not None:
            replay(s, [], now)
    calls = sink.take()
    assert calls.count(("synced",)) == 2 and calls.count(("reset",)) == 1
    assert s.counters.resyncs == 1 and s.counters.stale_batches == 1
    s.on_live(1, b"p1", 11.0)
    assert sink.applied == [0, 1]


def test_full_resync_drops_pending_batches():
    s, sink = started()
    replay(s, [0])
    s.on_live(3, b"p3", 1.0)          # gap: replay from 1 asked, 3 pending
    s.on_live(0, b"new0", 1.1)        # restart: full resync
    assert s._pending == {0: b"new0"}


def test_idle_engine_that_published_nothing_keeps_its_session():
    s, sink = started(probe_interval_s=2.0, engine_timeout_s=30.0)
    s.on_replay_end(0.0)
    assert sink.take() == [("synced",)]
    for i in range(1, 6):             # 10 s of probes, each answered by the end marker
        s.on_tick(2.0 * i)
        assert sink.take() == [("replay", 0)]
        s.on_replay_end(2.0 * i)
    assert sink.take() == [] and s.counters.resyncs == 0 and s.counters.probes == 5
    s.on_tick(12.0)
    replay(s, [0, 1], 12.0)           # the probe that finds the first batches applies them
    assert sink.take() == [("replay", 0), ("apply", 0), ("apply", 1)]


def test_publisher_restart_resyncs():
    s, sink = started()
    replay(s, [0, 1, 2])
    s.on_live(3, b"p3", 1.0)
    sink.take()
    s.on_live(0, b"new0", 2.0)  # seq went back: a new publisher
    assert sink.take() == [("reset",), ("replay", 0)]
    assert s.counters.restarts == 1
    replay(s, [0], 2.1)
    assert sink.take() == [("apply", 0), ("synced",)]


def test_reconnect_resyncs():
    s, sink = started()
    replay(s, [0])
    sink.take()
    s.on_reconnect(1.0)
    assert sink.take() == [("reset",), ("replay", 0)]


def test_undecodable_batch_resyncs_and_is_skipped_in_the_resync():
    s, sink = started()
    replay(s, [0])
    s.on_live(1, b"bad", 1.0)
    assert sink.take()[-2:] == [("reset",), ("replay", 0)]
    s.on_replay(0, b"p0", 1.1)
    s.on_replay(1, b"bad", 1.1)
    s.on_replay(2, b"p2", 1.1)
    s.on_replay_end(1.1)
    assert sink.applied == [0, 2]
    assert s.counters.bad_payloads == 2 and s.counters.resyncs == 1


def test_probe_liveness_down_and_back():
    s, sink = started(probe_interval_s=1.0, engine_timeout_s=5.0, replay_timeout_s=2.0)
    replay(s, [0, 1])
    sink.take()
    s.on_tick(0.5)
    assert sink.take() == []
    s.on_tick(1.0)                       # idle for a probe interval: probe
    assert sink.take() == [("replay", 2)] and s.counters.probes == 1
    s.on_replay_end(1.1)                 # it answers: alive
    s.on_tick(3.5)
    assert sink.take() == [("replay", 2)]
    s.on_tick(5.6)                       # probe unanswered: timed out, probe again
    assert s.counters.replay_timeouts == 1 and sink.take() == [("replay", 2)]
    s.on_tick(6.2)                       # nothing heard since 1.1
    assert sink.take() == [("reset",), ("down",)] and not s.up
    s.on_tick(7.0)                       # down: keep asking for everything
    assert sink.take() == [("replay", 0)]
    s.on_tick(7.5)
    assert sink.take() == []
    s.on_tick(9.1)
    assert sink.take() == [("replay", 0)] and s.counters.replay_timeouts == 2
    replay(s, [0, 1, 2, 3], 9.4)         # it came back (or restarted)
    assert sink.take()[-1] == ("synced",) and s.up


def test_without_replay_endpoint():
    sink = Sink()
    s = EventStream(sink, StreamOptions(has_replay=False, engine_timeout_s=0.1))
    s.start(0.0)
    s.on_live(4, b"p4", 0.0)
    s.on_live(5, b"p5", 0.0)
    assert sink.take() == [("synced",), ("apply", 4), ("apply", 5)]
    s.on_live(8, b"p8", 0.0)  # a gap nothing can fill: start again from here
    assert sink.take() == [("reset",), ("synced",), ("apply", 8)]
    s.on_tick(100.0)  # never declared down
    s.on_live(0, b"p0", 100.0)  # restarted
    assert sink.take() == [("reset",), ("synced",), ("apply", 0)]
    assert s.counters.lost_batches == 2


def test_pending_is_bounded():
    s, sink = started(max_pending=3)
    for q in range(10):
        s.on_live(q, b"p%d" % q, 0.0)
    replay(s, [0, 1, 2, 3, 4, 5, 6], 0.1)
    assert sink.applied == list(range(10))


def test_hole_in_a_replay_is_asked_again():
    # vLLM's ROUTER drops what its send queue cannot hold: a replay may skip batches.
    s, sink = started()
    s.on_live(9, b"p9", 0.0)
    replay(s, [0, 1, 2, 5, 6, 7], 0.1)   # 3 and 4 dropped: nothing after the hole applied
    assert sink.take()[-1] == ("replay", 3) and s.counters.replay_holes == 1
    assert sink.applied == [0, 1, 2] and not s.up
    s.on_live(10, b"p10", 0.2)            # still syncing: kept
    replay(s, [3, 4, 5, 6, 7, 8, 9], 0.3)
    assert sink.take() == [("apply", q) for q in range(3, 11)][:7] + [("synced",),
                                                                      ("apply", 10)]
    assert sink.applied == list(range(11)) and s.up


def test_replay_timeout_while_syncing_resumes_without_applying_live_batches():
    s, sink = started(replay_timeout_s=1.0, probe_interval_s=0.5)
    s.on_replay(0, b"p0", 0.1)            # the end marker never comes
    s.on_tick(1.2)
    assert sink.take()[-1] == ("replay", 1) and s.counters.replay_timeouts == 1
    s.on_live(5, b"p5", 1.3)              # kept: history first
    replay(s, [1, 2, 3, 4, 5], 1.4)
    assert sink.applied == [0, 1, 2, 3, 4, 5] and s.up


def test_a_seq_missing_from_the_engines_own_history_is_skipped_not_resynced_forever():
    # SGLang's / vLLM's publisher consumed seq 2 but never sent or buffered it.
    s, sink = started()
    replay(s, [0, 1])
    s.on_live(3, b"p3", 0.1)                    # gap: 2 missing
    assert sink.take()[-1] == ("replay", 2)
    replay(s, [3], 0.1, end=False)              # the buffer lacks 2: resync from 0
    assert sink.take() == [("reset",), ("replay", 0)]
    replay(s, [0, 1, 3], 0.2)                   # the same hole: asked again from it
    assert sink.take()[-1] == ("replay", 2)
    replay(s, [3], 0.3)                         # twice unreachable: skipped, counted lost
    assert sink.take() == [("apply", 3), ("synced",)]
    assert sink.applied == [0, 1, 3] and s.up and s.counters.lost_batches == 2
    s.on_live(4, b"p4", 0.4)
    assert sink.applied == [0, 1, 3, 4]
