"""An SGLang KV-event source for tests, made of SGLang's own code: its
UnifiedRadixCache (built as SGLang's own unit-test kit builds one, on CPU) records the events
with SGLang's hashing, and its ZmqEventPublisher sends them. Run by SGLang's Python, not
kvcm's (it imports no kvcm):

    python sglang_publisher.py --endpoint tcp://127.0.0.1:P --replay tcp://127.0.0.1:R \
        --page-size 4 [--dynamo]

Reads one JSON command a line on stdin, answers one JSON line on stdout:
  {"op": "insert", "tokens": [...], "salt": null}  insert a prompt; publish the events
  {"op": "evict", "num_tokens": N}                 evict least recently used; publish
  {"op": "reset"}                                   drop the whole cache; publish
  {"op": "struct", "events": [{"type": ..., ...}]}  SGLang's event structs, as given; publish
  {"op": "raw", "payload_hex": "..."}               these bytes as the next batch's payload
  {"op": "skip_seq"}                                the next batch's sequence number is lost
  {"op": "quit"}
Each answer holds the events published, as SGLang's structs encode to builtins.

With --prompt (repeatable; token ids separated by spaces), it reads no stdin: it inserts each
prompt, prints the answers, and serves its live and replay sockets until killed (SIGTERM), as
an engine that served those prompts would (README's engines-sglang walk-through).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from array import array


def _radix_cache(page_size: int, dynamo: bool):
    """SGLang's UnifiedRadixCache on CPU, built as its own unit-test kit builds one
    (sglang/test/kits/unified_radix_cache/fixtures.py, build_fixture: full attention only)."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    kv_size = 4096
    req_pool = ReqToTokenPool(size=8, max_context_len=2048, device="cpu",
                              enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=kv_size, page_size=page_size, dtype=torch.bfloat16,
                               head_num=1, head_dim=8, layer_num=1, device="cpu",
                               enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=kv_size, dtype=torch.bfloat16, device="cpu",
                                       kvcache=kv_pool, need_sort=False)
    cache = UnifiedRadixCache(params=CacheInitParams(
        req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
        page_size=page_size, disable=False, enable_kv_cache_events=True,
        dynamo_kv_event_format=dynamo, tree_components=(ComponentType.FULL,)))
    return cache, allocator


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--replay", default=None)
    p.add_argument("--topic", default="")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--dynamo", action="store_true")
    p.add_argument("--prompt", action="append", default=[],
                   help="insert these token ids (separated by spaces), then serve until killed")
    args = p.parse_args()

    import msgspec
    from sglang.srt.disaggregation import kv_events as kve
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, allocator = _radix_cache(args.page_size, args.dynamo)
    pub = kve.ZmqEventPublisher(attn_dp_rank=0, endpoint=args.endpoint, bind=True,
                                replay_endpoint=args.replay, topic=args.topic)

    def publish(events: list) -> list:
        if events:
            pub.publish(kve.KVEventBatch(ts=time.time(), events=events))
        return [msgspec.to_builtins(e) for e in events]

    def handle(cmd: dict) -> dict:
        op = cmd["op"]
        out: dict = {"op": op}
        if op == "insert":
            tokens = cmd["tokens"]
            key = RadixKey(array("q", tokens), cache_salt=cmd.get("salt"))
            value = allocator.alloc(len(tokens))
            cache.insert(InsertParams(key=key, value=value[:len(key)]))
            out["events"] = publish(cache.take_events())
        elif op == "evict":
            cache.evict(EvictParams(num_tokens=cmd["num_tokens"]))
            out["events"] = publish(cache.take_events())
        elif op == "reset":
            cache.reset()
            out["events"] = publish(cache.take_events())
        elif op == "struct":
            events = []
            for e in cmd["events"]:
                e = dict(e)
                events.append(getattr(kve, e.pop("type"))(**e))
            out["events"] = publish(events)
        elif op == "raw":
            # SGLang's publisher thread encodes what it dequeues; a Raw encodes as itself.
            pub._event_queue.put(msgspec.Raw(bytes.fromhex(cmd["payload_hex"])))
        elif op == "skip_seq":
            next(pub._seq_gen)
        return out

    print(json.dumps({"ready": True}), flush=True)
    try:
        if args.prompt:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            for prompt in args.prompt:
                cmd = {"op": "insert", "tokens": [int(t) for t in prompt.split()]}
                print(json.dumps(handle(cmd)), flush=True)
            while True:
                signal.pause()
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            print(json.dumps(handle(cmd)), flush=True)
    finally:
        pub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
