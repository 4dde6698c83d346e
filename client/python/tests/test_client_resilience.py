"""Client addresses, TLS / plaintext mismatch hints and the retry schedule against real
kvcm-manager binaries (issue 26)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import kvcm
import kvcm.aio
import test_tls

secured = test_tls.secured  # the fixture: a manager serving mutual TLS

POOL = kvcm.PoolRef("gpu-0")


@pytest.mark.parametrize("make", [kvcm.Client, kvcm.aio.Client])
def test_an_address_without_a_port_is_refused_with_the_fix(make) -> None:
    with pytest.raises(ValueError, match=r"address 'localhost' has no port; the manager "
                                         r"listens on 50051 by default: localhost:50051"):
        make("localhost", insecure=True)
    with pytest.raises(kvcm.InvalidArgument, match=r"IPv6 address needs brackets"):
        make("::1", insecure=True)
    with pytest.raises(kvcm.InvalidArgument, match=r"port in 1\.\.65535"):
        make("h:99999", insecure=True)


def test_gRPC_targets_and_bracketed_v6_are_accepted() -> None:
    for address in ("[::1]:50051", "dns:///kvcm.internal:50051", "unix:/tmp/kvcm.sock"):
        kvcm.Client(address, insecure=True).close()


def test_manager_address_comes_from_the_environment(monkeypatch, manager) -> None:
    monkeypatch.setenv("KVCM_MANAGER_ADDRESS", manager.address)
    with kvcm.Client(insecure=True) as client:
        assert client.options.address == manager.address
        assert client.stats().active_pins == 0
    monkeypatch.setenv("KVCM_MANAGER_ADDRESS", "nowhere")
    with pytest.raises(ValueError, match="address 'nowhere' has no port"):
        kvcm.Client(insecure=True)
    monkeypatch.delenv("KVCM_MANAGER_ADDRESS")
    assert kvcm.Client(insecure=True).options.address == "127.0.0.1:50051"


def test_plaintext_client_of_a_tls_manager_is_told_to_use_tls(secured) -> None:
    manager, _, _ = secured
    with kvcm.Client(manager.address, insecure=True) as plain:
        with pytest.raises(kvcm.Unavailable, match=r"the server may require TLS: pass "
                                                   r"--tls_ca_file"):
            plain.stats(deadline_ms=1500)


def test_tls_client_without_a_certificate_is_told_to_pass_one(secured) -> None:
    manager, certs, _ = secured  # serves mutual TLS
    with kvcm.Client(manager.address, ca_file=str(certs / "ca.pem")) as no_cert:
        with pytest.raises(kvcm.Unavailable, match=r"the server may require a client "
                                                   r"certificate it trusts: pass --tls_cert_file"):
            no_cert.stats(deadline_ms=1500)


def test_tls_client_of_a_plaintext_manager_is_told_it_may_be_plaintext(manager, workdir) -> None:
    import subprocess

    certs = workdir / "certs"
    subprocess.run([str(test_tls.REPO_ROOT / "scripts" / "make_test_certs.sh"), str(certs)],
                   check=True, capture_output=True)
    with kvcm.Client(manager.address, ca_file=str(certs / "ca.pem")) as tls:
        with pytest.raises(kvcm.Unavailable, match=r"the server may be plaintext: pass "
                                                   r"--insecure"):
            tls.stats(deadline_ms=1500)


def test_refused_connection_gets_no_tls_hint(manager_factory) -> None:
    address = manager_factory().address  # never started
    with kvcm.Client(address, insecure=True, max_attempts=2) as client:
        with pytest.raises(kvcm.Unavailable) as e:
            client.stats()
        assert "TLS" not in e.value.message


def test_default_schedule_spans_a_manager_takeover() -> None:
    """Idempotent calls retry for at least the etcd lease TTL (5 s) plus an election, within
    the default deadline."""
    options = kvcm.ClientOptions()
    assert options.default_deadline_ms >= 8000
    # Equal jitter sleeps at least half of each backoff: the attempts still span >= 8 s.
    ms, slept = options.initial_backoff_ms, 0.0
    for _ in range(options.max_attempts - 1):
        slept += ms / 2
        ms = min(ms * options.backoff_multiplier, options.max_backoff_ms)
    assert slept >= 8000 >= options.initial_backoff_ms


def restart_after(manager, gap_s: float) -> threading.Thread:
    """Kills `manager` now and starts it again on the same port after gap_s."""
    manager.kill()
    thread = threading.Timer(gap_s, manager.start)
    thread.start()
    return thread


def test_a_call_during_a_restart_succeeds_under_the_default_policy(manager) -> None:
    with kvcm.Client(manager.address, insecure=True) as client:
        assert client.stats().active_pins == 0
        restarting = restart_after(manager, 3.0)
        t0 = time.monotonic()
        stats = client.stats()  # started in the gap; default options
        elapsed = time.monotonic() - t0
        restarting.join()
        assert stats.active_pins == 0 and elapsed >= 2.5
        assert client.counters.retries >= 1


@pytest.mark.asyncio
async def test_an_async_call_during_a_restart_succeeds_under_the_default_policy(manager) -> None:
    async with kvcm.aio.Client(manager.address, insecure=True) as client:
        assert (await client.stats()).active_pins == 0
        restarting = await asyncio.to_thread(restart_after, manager, 3.0)
        t0 = time.monotonic()
        stats = await client.stats()
        assert stats.active_pins == 0 and time.monotonic() - t0 >= 2.5
        await asyncio.to_thread(restarting.join)


def test_non_idempotent_calls_give_up_after_their_own_attempts(manager_factory) -> None:
    address = manager_factory().address  # never started
    with kvcm.Client(address, insecure=True, non_idempotent_max_attempts=3) as client:
        with pytest.raises(kvcm.Unavailable, match=r"\(after 3 attempts\)"):
            client.reserve(POOL, 1)
        with pytest.raises(kvcm.Unavailable, match=r"\(after 3 attempts\)"):
            client.evict_from_pool(POOL, 1)
    with pytest.raises(kvcm.InvalidArgument, match="non_idempotent_max_attempts"):
        kvcm.Client(address, insecure=True, non_idempotent_max_attempts=0)


def test_the_proto_says_which_calls_retry_fully() -> None:
    """The retry sets come from the proto's idempotency_level; this pins them (the C++
    client's ClientRetryTest.TheProtoSaysWhichCallsRetryFully pins the same)."""
    from kvcm._commands import _SERVICE, retries_fully

    not_fully = {m.name for m in _SERVICE.methods if not retries_fully(m.name)}
    assert not_fully == {"Evict", "ForgetAgent", "Reserve", "Unreserve"}


def test_bridge_logs_the_tls_hint(secured, tmp_path) -> None:
    pytest.importorskip("zmq")
    import subprocess
    import sys

    from conftest import free_port

    manager, _, _ = secured
    log = tmp_path / "bridge.log"
    with open(log, "wb") as out:
        bridge = subprocess.Popen(
            [sys.executable, "-m", "kvcm.engines.bridge", "--manager_address", manager.address,
             "--insecure", "--tenant", "acme", "--model", "m", "--preset", "llama-3-8b",
             "--engine", f"id=e0,endpoint=tcp://127.0.0.1:{free_port()}"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 30
        while "the server may require TLS" not in log.read_text():
            assert bridge.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.2)
    finally:
        bridge.kill()
        bridge.wait()
