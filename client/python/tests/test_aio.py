"""kvcm.aio.Client against a real kvcm-manager process."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import List

import pytest

import kvcm
import kvcm.aio
from conftest import Manager, prompt

NS = kvcm.Namespace("acme", "deepseek-v3")
GPU0 = kvcm.PoolRef("gpu-0")
PAGE = 64


@pytest.mark.asyncio
async def test_register_insert_match_and_pin(manager: Manager) -> None:
    async with kvcm.aio.Client(manager.address, insecure=True) as client:
        reply = await client.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        assert reply.created and client.hashes_locally(NS)
        tokens = prompt(300)
        ins = await client.insert(NS, tokens, GPU0, range(4))
        assert ins.new_pages == 4
        m = await client.match(NS, tokens, requester_agent_id="gpu-0")
        assert (m.matched_pages, m.local_pages) == (4, 4)
        assert [page[0].block_id for page in m.pages] == [0, 1, 2, 3]

        async with client.match_and_pin(NS, tokens) as prefix:
            assert prefix.pin_id != 0 and prefix.match.matched_tokens == 4 * PAGE
            assert (await client.stats()).active_pins == 1
            assert await prefix.renew(30000) == prefix.match.lease_expiry_unix_ms
        assert prefix.pin_id == 0
        assert (await client.stats()).active_pins == 0

        # Awaited instead of entered: released explicitly.
        pinned = await client.match_and_pin(NS, tokens)
        assert (await client.stats()).active_pins == 1
        await pinned.release()
        stats = await client.stats()
        assert stats.active_pins == 0 and stats.counters.pins_released == 2


@pytest.mark.asyncio
async def test_errors_carry_codes(manager: Manager) -> None:
    async with kvcm.aio.Client(manager.address, insecure=True) as client:
        with pytest.raises(kvcm.NotFound):
            await client.match(NS, prompt(64))
        await client.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        with pytest.raises(kvcm.NotFound):
            await client.release(NS, 99)
        with pytest.raises(kvcm.InvalidArgument, match="block_ids"):
            await client.insert(NS, prompt(128), GPU0, [5])
        with pytest.raises(kvcm.NotFound, match="pool gpu-0:gpu is not registered"):
            await client.evict_from_pool(GPU0, 1)
        assert (await client.stats()).counters.inserted_pages == 0


@pytest.mark.asyncio
async def test_concurrent_calls_on_one_client(manager: Manager) -> None:
    async with kvcm.aio.Client(manager.address, insecure=True) as client:
        await client.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        prompts = [prompt(128, seed=s) for s in range(20)]
        await asyncio.gather(
            *(
                client.insert(NS, p, kvcm.PoolRef(f"gpu-{i % 4}"), range(2))
                for i, p in enumerate(prompts)
            )
        )
        matches = await asyncio.gather(*(client.match(NS, p, probe=True) for p in prompts))
        assert [m.matched_pages for m in matches] == [2] * 20
        assert (await client.stats()).namespace(NS).pages == 40


@pytest.mark.asyncio
async def test_watch_events(manager: Manager) -> None:
    async with kvcm.aio.Client(manager.address, insecure=True) as client:
        await client.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        tokens = prompt(128)
        stream = client.watch_events()
        events: List[kvcm.CacheEvent] = []

        async def read() -> None:
            async for event in stream:
                events.append(event)
                return

        reader = asyncio.create_task(read())
        # A loaded CI machine subscribes slowly, so insert until the stream sees one. Each
        # insert is a new prompt: a prompt already stored stores nothing and sends no event.
        inserted: List[List[int]] = []
        deadline = time.monotonic() + 20
        while not reader.done() and time.monotonic() < deadline:
            tokens = prompt(128, seed=len(inserted))
            await client.insert(NS, tokens, GPU0, range(2 * len(inserted), 2 * len(inserted) + 2))
            inserted.append(client.hash_prompt(NS, tokens))
            await asyncio.sleep(0.05)
        await asyncio.wait_for(reader, 20)
        stream.cancel()
        assert events[0].kind == kvcm.EventKind.STORED
        assert events[0].page_hashes in inserted


@pytest.mark.asyncio
async def test_retries_until_a_late_manager_starts(manager_factory) -> None:
    manager = manager_factory()
    starter = threading.Timer(0.5, manager.start)
    async with kvcm.aio.Client(manager.address, insecure=True, max_attempts=100) as client:
        starter.start()
        stats = await client.stats(deadline_ms=20000)
        assert stats.active_pins == 0
        assert client.counters.retries >= 1
    starter.join()


@pytest.mark.asyncio
async def test_restart_reregisters(manager_factory) -> None:
    manager = manager_factory().start()
    async with kvcm.aio.Client(manager.address, insecure=True) as client:
        await client.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        tokens = prompt(128)
        await client.insert(NS, tokens, GPU0, range(2))
        await asyncio.get_running_loop().run_in_executor(None, manager.restart)
        assert (await client.insert(NS, tokens, GPU0, range(2))).new_pages == 2
        assert (await client.match(NS, tokens)).matched_pages == 2
