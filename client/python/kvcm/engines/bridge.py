"""kvcm-bridge (alias kvcm-vllm-bridge): mirrors engines' prefix caches into a kvcm-manager.

Serves vLLM and SGLang engines alike (each engine's `kind` picks its decoder,
kvcm.engines.kinds). Per engine, an `EngineBridge` runs two tasks on one asyncio loop: the ZMQ
side (SUB socket for live batches, a DEALER to the engine's replay ROUTER, a monitor for
reconnects) feeding an
`EventStream` that applies batches to an `EngineMirror`, and the publish side sending the
mirror's changes through a `PublishSession` (PublishEngineEvents). docs/ENGINES.md has the
whole story; `kvcm-bridge --help` the flags.

In bind mode the engine's publisher is one ZMQ connection: the first whose live batch the
engine's own replay endpoint (which the bridge dials) returns byte for byte, or without a
replay endpoint the first to deliver one. Until then, and from any other connection, live
batches are refused and counted (`foreign_batches`), so their sequence numbers and
AllBlocksCleared change nothing (the mirror follows the replay's probes meanwhile). CURVE
(per engine) admits only publishers with a listed key. docs/SECURITY.md, "kvcm-bridge".
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict

import grpc
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from kvcm._options import tls_mismatch_hint
from kvcm.engines.config import BridgeConfig, ConfigError, EngineConfig, from_args
from kvcm.engines import kinds
from kvcm.engines.events import EventDecodeError
from kvcm.engines.manager import ManagerConnection, Registration
from kvcm.engines.mirror import EngineMirror, Tier
from kvcm.engines.session import Action, PublishSession, SessionOptions, State
from kvcm.engines.stream import EventStream, StreamOptions
from kvcm.engines.wire import FrameError, parse_live, parse_replay, replay_request

log = logging.getLogger("kvcm.engines.bridge")

_TICK_S = 0.1
_MAX_DRAIN = 1000  # messages taken from one socket before looking at the others
_SLICE_S = 0.02    # work between two yields to the loop (the publisher, heartbeats)


class _Backoff:
    def __init__(self, first_s: float, max_s: float):
        self.first_s, self.max_s, self.next_s = first_s, max_s, first_s

    def take(self) -> float:
        s, self.next_s = self.next_s, min(self.next_s * 2, self.max_s)
        return s

    def reset(self) -> None:
        self.next_s = self.first_s


class EngineBridge:
    """One engine's mirror and session. Runs on one asyncio loop; not thread-safe, except
    `metrics` (an immutable snapshot, replaced about once a second)."""

    def __init__(self, cfg: BridgeConfig, engine: EngineConfig, manager: ManagerConnection,
                 ctx: zmq.asyncio.Context):
        self.cfg, self.engine, self._manager, self._ctx = cfg, engine, manager, ctx
        self.id = engine.id
        self.kind = kinds.get(engine.kind)
        self.tenant = engine.tenant or cfg.namespace.tenant
        self.model = engine.model or cfg.namespace.model
        self.spec = cfg.namespace.model_spec(engine.block_size)
        self.token = engine.resolve_token()
        self.register_token = self.token
        if cfg.register_token_file:
            with open(cfg.register_token_file, encoding="ascii") as f:
                self.register_token = f.read().strip()
        self.reg = Registration()
        self.mirror: EngineMirror | None = None
        self.session = PublishSession(SessionOptions(heartbeat_interval_s=cfg.ttl_ms / 3000))
        self.stream = EventStream(self, StreamOptions(
            has_replay=bool(engine.replay_endpoint), probe_interval_s=cfg.probe_interval_s,
            replay_timeout_s=cfg.replay_timeout_s, engine_timeout_s=cfg.engine_timeout_s))
        self.ignored_batches = 0     # other data-parallel ranks
        self.failures = 0            # loops restarted after a bug
        self.bad_frames = 0          # messages in none of the publisher frame forms
        self.replay_form = ""        # "seq" or "topic" once a replay answered
        self.metrics: dict = {}
        self._wake = asyncio.Event()
        self._dealer: zmq.asyncio.Socket | None = None
        self._poller = zmq.asyncio.Poller()
        self._sub_disconnected = False
        self._auth_failing = False
        # Bind mode: the source fd (ZMQ_SRCFD) of the publisher connection taken as the
        # engine's; None until one delivers a batch, and again once it closes.
        self._publisher_fd: int | None = None
        # Bind mode with a replay endpoint: connections not yet confirmed, fd -> {seq:
        # digest of the payload} of their last live batches, until a replay matches one.
        self._candidates: dict[int, dict[int, bytes]] = {}
        self._peers: dict[int, tuple[str, str]] = {}  # fd -> (peer address, CURVE key)
        self.foreign_batches = 0     # bind mode: batches of another publisher connection

    # ---- StreamSink -------------------------------------------------------------------

    def apply(self, seq: int, payload: bytes) -> bool:
        assert self.mirror is not None
        try:
            batch = self.kind.decode_batch(payload)
        except EventDecodeError as e:
            log.warning("engine %s: batch %d does not decode (%s)", self.id, seq, e)
            return False
        rank = self.engine.data_parallel_rank
        if rank is not None and batch.data_parallel_rank not in (None, rank):
            self.ignored_batches += 1
            return True
        try:
            self.mirror.apply_batch(batch.events)
        except Exception:  # a bug, not the engine's fault: resync rather than die
            log.exception("engine %s: applying batch %d failed", self.id, seq)
            return False
        self._forward()
        return True

    def request_replay(self, start_seq: int) -> None:
        # A new socket per request: answers to an abandoned request never reach it.
        if self._dealer is not None:
            self._poller.unregister(self._dealer)
            self._dealer.close(linger=0)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.RCVHWM, 0)  # take a whole replay as fast as it comes
        self._dealer.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes)
        self._dealer.connect(self.engine.replay_endpoint)
        self._poller.register(self._dealer, zmq.POLLIN)
        self._dealer.send_multipart(replay_request(start_seq))

    def reset(self) -> None:
        assert self.mirror is not None
        log.info("engine %s: resync (mirror forgotten, replaying what the engine buffers)",
                 self.id)
        self.mirror.reset()
        self.session.suspend()

    def synced(self) -> None:
        assert self.mirror is not None
        self.session.open(self.mirror.snapshot())
        self.mirror.take_changes()
        log.info("engine %s: synced, %d pages visible, new session", self.id,
                 sum(len(self.mirror.visible_pages(t)) for t in Tier))
        self._wake.set()

    def down(self) -> None:
        log.warning("engine %s: nothing heard for %.1f s: dropping its pools", self.id,
                    self.cfg.engine_timeout_s)
        self.session.close()
        self._wake.set()

    def _forward(self) -> None:
        assert self.mirror is not None
        changes = self.mirror.take_changes()
        if changes:
            self.session.add(changes)
            if self.session.overflowed:
                self.session.open(self.mirror.snapshot())
            self._wake.set()

    # ---- run --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        await self._register_until_ok(stop)
        if stop.is_set():
            return
        self.mirror = EngineMirror(self.reg.hash_key, self.reg.page_size,
                                   self.engine.block_size, self.engine.kv_group,
                                   self.engine.lora_by_name,
                                   self.engine.require_extra_keys,
                                   self.kind.verify_block)
        tasks = [asyncio.create_task(self._supervise(self._zmq_loop, stop),
                                     name=f"{self.id}-zmq"),
                 asyncio.create_task(self._supervise(self._publish_loop, stop),
                                     name=f"{self.id}-publish")]
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_session()

    async def _supervise(self, loop: Callable[[asyncio.Event], Awaitable[None]],
                         stop: asyncio.Event) -> None:
        """Runs a loop; a bug in it is logged and the loop starts again (the ZMQ side with
        a full resync), so one engine never takes the bridge down."""
        while not stop.is_set():
            try:
                await loop(stop)
                return
            except Exception:
                log.exception("engine %s: %s failed; restarting it", self.id, loop.__name__)
                self.failures += 1
                if loop == self._zmq_loop:
                    assert self.mirror is not None
                    self.mirror.reset()
                    self.session.suspend()
                    self.stream = EventStream(self, self.stream.options, self.stream.counters)
                    self._poller = zmq.asyncio.Poller()
                await _sleep_or_stop(stop, 1.0)

    async def _register(self) -> Registration:
        reg = await self._manager.register(self.tenant, self.model, self.spec,
                                           self.register_token,
                                           self.cfg.namespace.max_page_age_s)
        if reg.page_size != self.spec.page_size_tokens:
            raise ConfigError(f"engine {self.id}: namespace {self.tenant}/{self.model} has page "
                              f"size {reg.page_size}, configured {self.spec.page_size_tokens}")
        return reg

    async def _register_until_ok(self, stop: asyncio.Event) -> None:
        backoff = _Backoff(0.2, 30.0)
        while not stop.is_set():
            try:
                self.reg = await self._register()
                log.info("engine %s: namespace %s/%s registered (page size %d, engine block "
                         "size %d)", self.id, self.tenant, self.model, self.reg.page_size,
                         self.engine.block_size)
                return
            except grpc.aio.AioRpcError as e:
                self._count_error(e.code().name)
                log.error("engine %s: RegisterModel %s/%s failed: %s: %s", self.id,
                          self.tenant, self.model, e.code().name, self._details(e))
            except ConfigError as e:
                log.error("%s", e)
            await _sleep_or_stop(stop, backoff.take())

    def _details(self, e: grpc.aio.AioRpcError) -> str:
        """The error's text, with a hint when an UNAVAILABLE looks like a TLS mismatch."""
        details = e.details() or ""
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            details += tls_mismatch_hint(details, self.cfg.insecure)
        return details

    def _count_error(self, code: str) -> None:
        errs = self.session.counters.errors
        errs[code] = errs.get(code, 0) + 1

    async def _publish_loop(self, stop: asyncio.Event) -> None:
        backoff = _Backoff(0.1, 5.0)
        while not stop.is_set():
            now = time.monotonic()
            req = self.session.next_request(now)
            if req is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                res = await self._manager.publish(self.id, self.tenant, self.model, self.reg,
                                                  req, self.cfg.ttl_ms, self.token)
            except grpc.aio.AioRpcError as e:
                if self.session.session != req.session:
                    continue  # a new session began meanwhile: this answer is moot
                await self._on_publish_error(e, stop, backoff)
                continue
            if self.session.session == req.session:
                self.session.on_sent(time.monotonic(), res.stored_pages, res.removed_pages)
            backoff.reset()
            if self._auth_failing:
                log.info("engine %s: the manager accepts the token again", self.id)
                self._auth_failing = False

    async def _on_publish_error(self, e: grpc.aio.AioRpcError, stop: asyncio.Event,
                                backoff: _Backoff) -> None:
        code, msg = e.code().name, e.details() or ""
        was_open = self.session.state is State.OPEN
        action = self.session.on_failed(code, msg)
        assert self.mirror is not None
        if action is Action.RETRY:
            log.warning("engine %s: publish failed (%s: %s), retrying", self.id, code,
                        self._details(e))
            await _sleep_or_stop(stop, backoff.take())
        elif action is Action.NEW_SESSION:
            log.info("engine %s: the manager lost the session (%s), resending the mirror",
                     self.id, msg)
            if was_open:
                self.session.open(self.mirror.snapshot())
        elif action is Action.REREGISTER:
            log.warning("engine %s: %s: %s; registering again", self.id, code, msg)
            await _sleep_or_stop(stop, backoff.take())  # a refusal that persists stays slow
            await self._register_until_ok(stop)
            if self.reg.hash_key != self.mirror.ns_key:
                self.mirror.rekey(self.reg.hash_key)
            if was_open:
                self.session.open(self.mirror.snapshot())
        elif action is Action.AUTH:
            self._auth_failing = True
            log.error("engine %s: the manager refuses this engine's token (%s: %s); nothing "
                      "is published until it accepts it", self.id, code, msg)
            await _sleep_or_stop(stop, max(5.0, backoff.take()))
        else:
            log.error("engine %s: the manager refused a publish (%s: %s); resending the "
                      "mirror in a new session", self.id, code, msg)
            await _sleep_or_stop(stop, max(1.0, backoff.take()))
            if was_open:
                self.session.open(self.mirror.snapshot())

    async def _close_session(self) -> None:
        """Best effort close=true at shutdown, so the manager drops the pools now."""
        self.session.close()
        req = self.session.next_request(time.monotonic())
        if req is None:
            return
        try:
            await asyncio.wait_for(self._manager.publish(
                self.id, self.tenant, self.model, self.reg, req, self.cfg.ttl_ms, self.token),
                timeout=2.0)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            log.warning("engine %s: close at shutdown failed: %s", self.id, e)

    async def _zmq_loop(self, stop: asyncio.Event) -> None:
        e = self.engine
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, e.topic.encode())
        if e.curve:  # before bind: the mechanism is the listener's
            public, secret = e.curve_keys()
            sub.setsockopt(zmq.ZAP_DOMAIN, e.id.encode())
            sub.setsockopt(zmq.CURVE_SERVER, 1)
            sub.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sub.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self._publisher_fd = None
        self._candidates.clear()
        self._peers.clear()
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        if e.endpoint_mode == "bind":
            sub.bind(e.endpoint)
        else:
            sub.connect(e.endpoint)
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        log.info("engine %s: %s %s%s, replay %s", self.id,
                 "bound" if e.endpoint_mode == "bind" else "connected to", e.endpoint,
                 " (CURVE)" if e.curve else "",
                 e.replay_endpoint or "(none: gaps resync from the next batch)")
        self.stream.start(time.monotonic())
        next_metrics = 0.0
        try:
            while not stop.is_set():
                await asyncio.sleep(0)  # a ready poll does not yield: let the others run
                ready = dict(await self._poller.poll(int(_TICK_S * 1000)))
                now = time.monotonic()
                if sub in ready:
                    await self._drain_sub(sub, now)
                dealer = self._dealer
                if dealer is not None and dealer in ready:
                    await self._drain_dealer(dealer, now)
                if monitor in ready:
                    await self._drain_monitor(monitor, now)
                self.stream.on_tick(now)
                if now >= next_metrics:
                    self.metrics = self._snapshot()
                    next_metrics = now + 1.0
        finally:
            self.metrics = self._snapshot()
            sub.disable_monitor()
            for s in (sub, monitor, self._dealer):
                if s is not None:
                    s.close(linger=0)
            self._dealer = None

    async def _drain_sub(self, sub: zmq.asyncio.Socket, now: float) -> None:
        for _ in range(_MAX_DRAIN):
            if not _readable(sub):
                return
            if time.monotonic() - now > _SLICE_S:
                return  # the next poll comes back at once
            parts = await sub.recv_multipart(copy=False)
            frames = [p.bytes for p in parts]
            try:
                seq, payload = parse_live(frames)
            except FrameError as e:
                if self.engine.endpoint_mode == "bind" and not self._from_publisher(
                        parts[0], -1, b""):
                    continue
                self._warn_frame(str(e))
                self.stream.counters.bad_payloads += 1
                continue
            if self.engine.endpoint_mode == "bind" and not self._from_publisher(
                    parts[0], seq, payload):
                continue
            self.stream.on_live(seq, payload, now)

    async def _drain_dealer(self, dealer: zmq.asyncio.Socket, now: float) -> None:
        for _ in range(_MAX_DRAIN):
            if dealer is not self._dealer or not _readable(dealer):
                return
            if time.monotonic() - now > _SLICE_S:
                return
            frames = await dealer.recv_multipart()
            try:
                r = parse_replay(frames)
            except FrameError as e:
                self._warn_frame(str(e))
                self.stream.on_bad_reply(now)
                return
            if r.form != self.replay_form:
                self.replay_form = r.form
                log.info("engine %s: replay answers in the %s form (%s)", self.id, r.form,
                         "vLLM <= 0.25" if r.form == "seq" else "vLLM >= 0.26, SGLang")
            if r.seq is None:
                self.stream.on_replay_end(now)
            else:
                if self._candidates:
                    self._confirm(r.seq, r.payload)
                self.stream.on_replay(r.seq, r.payload, now)

    def _from_publisher(self, frame: zmq.Frame, seq: int, payload: bytes) -> bool:
        """Bind mode: whether a message came over the engine's publisher connection. With a
        replay endpoint, a connection becomes it once the replay confirms one of its batches
        (_confirm); without, the first connection to deliver a batch does."""
        fd = frame.get(zmq.SRCFD)
        if fd == self._publisher_fd:
            return True
        if self._publisher_fd is None:
            if not self.engine.replay_endpoint:
                self._take_publisher(fd, frame)
                return True
            if seq >= 0 and (fd in self._candidates or len(self._candidates) < 16):
                seen = self._candidates.setdefault(fd, {})
                seen[seq] = hashlib.blake2b(payload, digest_size=16).digest()
                if len(seen) > 64:
                    del seen[min(seen)]
                self._peers[fd] = (_frame_property(frame, "Peer-Address"),
                                   _frame_property(frame, "User-Id"))
        self.foreign_batches += 1
        if self.foreign_batches <= 5 or self.foreign_batches % 1000 == 0:
            log.warning("engine %s: a live batch from publisher connection fd %d (from %s) "
                        "refused: %s (%d refused so far)", self.id, fd,
                        _frame_property(frame, "Peer-Address") or "?",
                        f"the engine publishes over fd {self._publisher_fd}"
                        if self._publisher_fd is not None else
                        "no replay has confirmed it as the engine's yet",
                        self.foreign_batches)
        return False

    def _take_publisher(self, fd: int, frame: zmq.Frame | None) -> None:
        self._publisher_fd = fd
        if frame is not None:
            who, key = (_frame_property(frame, "Peer-Address"),
                        _frame_property(frame, "User-Id"))
        else:
            who, key = self._peers.get(fd, ("", ""))
        self._candidates.clear()
        self._peers.clear()
        log.info("engine %s: publisher connection taken (fd %d, from %s%s)", self.id, fd,
                 who or "?", f", CURVE key {key}" if key else "")

    def _confirm(self, seq: int, payload: bytes) -> None:
        """A replayed batch (the engine's own word): the candidate connection that sent the
        same batch live is the engine's publisher."""
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        for fd, seen in self._candidates.items():
            if seen.get(seq) == digest:
                self._take_publisher(fd, None)
                return

    def _warn_frame(self, message: str) -> None:
        """Logs the first few malformed messages, then one in a thousand."""
        self.bad_frames += 1
        if self.bad_frames <= 5 or self.bad_frames % 1000 == 0:
            log.warning("engine %s: %s (%d so far)", self.id, message, self.bad_frames)

    async def _drain_monitor(self, monitor: zmq.asyncio.Socket, now: float) -> None:
        while _readable(monitor):
            message = parse_monitor_message(await monitor.recv_multipart())
            event = message["event"]
            if event == zmq.EVENT_DISCONNECTED:
                if self.engine.endpoint_mode == "bind":
                    if message["value"] != self._publisher_fd:
                        self._candidates.pop(message["value"], None)
                        continue  # not the engine's publisher: nothing to resync
                    self._publisher_fd = None
                self._sub_disconnected = True
            elif self._sub_disconnected:
                self._sub_disconnected = False
                log.info("engine %s: publisher reconnected", self.id)
                self.stream.on_reconnect(now)

    def _snapshot(self) -> dict:
        m = self.mirror
        snap = {
            "up": int(self.stream.up),
            "synced": int(self.session.state is State.OPEN),
            "stream": asdict(self.stream.counters),
            "session": asdict(self.session.counters),
            "ignored_batches": self.ignored_batches,
            "foreign_batches": self.foreign_batches,
            "failures": self.failures,
            "bad_frames": self.bad_frames,
            "outbox_pages": self.session.outbox_pages,
        }
        if m is not None:
            c = m.counters
            snap["mirror"] = {
                "events": dict(c.events), "blocks_stored": c.blocks_stored,
                "blocks_removed": c.blocks_removed, "refused_blocks": dict(c.refused_blocks),
                "ignored_events": dict(c.ignored_events),
                "unknown_removals": c.unknown_removals, "conflicts": c.conflicts,
                "restored_blocks": c.restored_blocks, "shared_pages": c.shared_pages,
                "unkeyed_blocks": c.unkeyed_blocks,
                "ignored_fields": dict(c.ignored_fields),
                "unknown_fields": dict(c.unknown_fields),
                "orphans": m.orphans, "known_blocks": m.known_blocks,
                "held_blocks": {t.name: m.held_blocks(t) for t in Tier},
                "visible_pages": {t.name: len(m.visible_pages(t)) for t in Tier},
            }
        return snap


def _frame_property(frame: zmq.Frame, name: str) -> str:
    try:
        return frame.get(name)  # type: ignore[return-value]
    except zmq.ZMQError:
        return ""


def _readable(sock: zmq.asyncio.Socket) -> bool:
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)  # type: ignore[arg-type]


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass


class Bridge:
    """Every configured engine, one manager channel, optional /metrics."""

    def __init__(self, cfg: BridgeConfig):
        cfg.validate()
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.auth: AsyncioAuthenticator | None = None
        curve = [e for e in cfg.engines if e.curve]
        if curve:  # one ZAP handler for the context; each engine is a domain of its own
            self.auth = AsyncioAuthenticator(self.ctx, log=logging.getLogger(
                "kvcm.engines.bridge.zap"))
            self.auth.start()
            for e in curve:
                self.auth.configure_curve(domain=e.id, location=e.curve_publisher_keys_dir)
        self.manager = ManagerConnection(cfg.manager_address, insecure=cfg.insecure,
                                         tls_ca_file=cfg.tls_ca_file, tls_cert_file=cfg.tls_cert_file,
                                         tls_key_file=cfg.tls_key_file,
                                         deadline_ms=cfg.deadline_ms)
        self.engines = [EngineBridge(cfg, e, self.manager, self.ctx) for e in cfg.engines]

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await asyncio.gather(*(e.run(stop) for e in self.engines))
        finally:
            await self.manager.close()
            if self.auth is not None:
                self.auth.stop()
            self.ctx.destroy(linger=0)


def main(argv: list[str] | None = None, prog: str = "kvcm-bridge") -> int:
    try:
        cfg, args = from_args(argv, prog)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.insecure:
        log.warning("*** --insecure: the manager is reached in plaintext; the engines' tokens "
                    "cross the network unencrypted ***")

    async def run() -> None:
        bridge = Bridge(cfg)  # inside the loop: grpc.aio and zmq.asyncio bind to it
        if cfg.metrics_address:
            from kvcm.engines.metrics import serve_metrics
            host, _, port = cfg.metrics_address.rpartition(":")
            serve_metrics(bridge.engines, host.strip("[]"), int(port))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await bridge.run(stop)

    try:
        asyncio.run(run())
    except (ConfigError, ValueError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
