"""kvcm.hashing, both backends, against tests/data/page_hash_vectors.txt (as the C++ does)."""

from __future__ import annotations

import array
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import List, NamedTuple

import pytest

import kvcm.hashing as hashing
from kvcm.hashing import pure

from conftest import REPO_ROOT, require_or_skip


class NsVector(NamedTuple):
    secret: bytes
    tenant: str
    model: str
    key: bytes
    fingerprint: int


class PagesVector(NamedTuple):
    key: bytes
    page_size: int
    tokens: List[int]
    hashes: List[bytes]


def _load_vectors() -> tuple[list[NsVector], list[PagesVector]]:
    ns, pages = [], []
    path = REPO_ROOT / "tests" / "data" / "page_hash_vectors.txt"
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        f = line.split(" ")
        if f[0] == "ns":
            ns.append(NsVector(bytes.fromhex(f[1]), f[2], f[3], bytes.fromhex(f[4]), int(f[5])))
        elif f[0] == "pages":
            pages.append(
                PagesVector(
                    bytes.fromhex(f[1]),
                    int(f[2]),
                    [int(t) for t in f[3].split(",")],
                    [bytes.fromhex(h) for h in f[4].split(",")] if len(f) > 4 else [],
                )
            )
    assert len(ns) == 9 and len(pages) == 4, f"unexpected vector file {path}"
    return ns, pages


NS_VECTORS, PAGES_VECTORS = _load_vectors()


def _native() -> ModuleType:
    if hashing.native is None:
        require_or_skip("the C++ extension kvcm._pagehash is not built")
    return hashing.native


@pytest.fixture(params=["extension", "pure"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return _native() if request.param == "extension" else pure


def test_extension_is_the_default_backend() -> None:
    _native()
    if os.environ.get("KVCM_PURE_PYTHON_HASH") != "1":
        assert hashing.BACKEND == "extension"


def test_env_forces_pure_python() -> None:
    env = dict(os.environ, KVCM_PURE_PYTHON_HASH="1")
    out = subprocess.run(
        [sys.executable, "-c", "import kvcm.hashing as h; print(h.BACKEND, h.native)"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == ["pure", "None"]


def test_siphash_reference_vectors(impl: ModuleType) -> None:
    key = bytes(range(16))
    assert impl.siphash128(key, b"").hex() == "a3817f04ba25a8e66df67214c7550293"
    assert impl.siphash128(key, bytes(range(9))).hex() == "264499060ad9baabc47f8b02bb6d71ed"
    # Every tail length 0..7 and several words, against the other backend.
    for n in range(0, 40):
        data = bytes(range(n))
        assert impl.siphash128(key, data) == pure.siphash128(key, data)


@pytest.mark.parametrize("v", NS_VECTORS, ids=lambda v: f"{v.secret.hex()[:4]}-{v.tenant}")
def test_namespace_key_and_fingerprint(impl: ModuleType, v: NsVector) -> None:
    assert impl.namespace_key(v.secret, v.tenant, v.model) == v.key
    assert impl.key_fingerprint(v.key) == v.fingerprint


@pytest.mark.parametrize("v", PAGES_VECTORS, ids=lambda v: f"page{v.page_size}")
def test_page_vectors_every_token_container(impl: ModuleType, v: PagesVector) -> None:
    containers = {
        "list": v.tokens,
        "tuple": tuple(v.tokens),
        "array_i": array.array("i", v.tokens),
        "array_q": array.array("q", v.tokens),
        "bytes": array.array("i", v.tokens).tobytes(),
        "bytearray": bytearray(array.array("i", v.tokens).tobytes()),
        "memoryview": memoryview(array.array("i", v.tokens)),
        "range_or_gen_list": list(iter(v.tokens)),
    }
    if min(v.tokens) >= 0:
        containers["array_I"] = array.array("I", v.tokens)
        containers["array_L"] = array.array("L", v.tokens)
    for name, tokens in containers.items():
        assert impl.hash_pages(v.key, tokens, v.page_size) == v.hashes, name


@pytest.mark.parametrize("v", PAGES_VECTORS, ids=lambda v: f"page{v.page_size}")
def test_hash_page_chains_and_prev_continues(impl: ModuleType, v: PagesVector) -> None:
    prev = hashing.ZERO_HASH
    for i, expected in enumerate(v.hashes):
        page = v.tokens[i * v.page_size : (i + 1) * v.page_size]
        prev = impl.hash_page(v.key, prev, page)
        assert prev == expected
    # Continuing a chain from any page boundary gives the rest of the hashes.
    for cut in range(len(v.hashes) + 1):
        head = impl.hash_pages(v.key, v.tokens[: cut * v.page_size], v.page_size)
        start = head[-1] if head else hashing.ZERO_HASH
        tail = impl.hash_pages(v.key, v.tokens[cut * v.page_size :], v.page_size, start)
        assert head + tail == v.hashes


def test_strided_buffer_is_read_as_a_sequence(impl: ModuleType) -> None:
    v = PAGES_VECTORS[0]
    doubled = array.array("i", [t for t in v.tokens for _ in (0, 1)])
    strided = memoryview(doubled)[::2]  # not contiguous
    assert impl.hash_pages(v.key, strided, v.page_size) == v.hashes


def test_numpy_arrays_when_available(impl: ModuleType) -> None:
    np = pytest.importorskip("numpy")
    v = PAGES_VECTORS[3]
    for dtype in (np.int32, np.int64, np.uint32):
        assert impl.hash_pages(v.key, np.array(v.tokens, dtype=dtype), v.page_size) == v.hashes
    assert impl.hash_pages(v.key, np.array(v.tokens, dtype=np.int32)[::1], v.page_size) == v.hashes


def test_extension_agrees_with_pure_on_random_prompts() -> None:
    native = _native()
    rng = random.Random(11)
    for _ in range(50):
        key = rng.randbytes(16)
        prev = rng.randbytes(16) if rng.random() < 0.5 else hashing.ZERO_HASH
        page = rng.randint(1, 70)
        tokens = [rng.randint(-(2**31), 2**31 - 1) for _ in range(rng.randint(0, 300))]
        assert native.hash_pages(key, tokens, page, prev) == pure.hash_pages(
            key, tokens, page, prev
        )
        assert native.hash_page(key, prev, tokens) == pure.hash_page(key, prev, tokens)


def test_bad_input_names_the_argument(impl: ModuleType) -> None:
    key = bytes(16)
    with pytest.raises(ValueError, match="key: must be 16 bytes, got 15"):
        impl.hash_pages(bytes(15), [1, 2], 1)
    with pytest.raises(ValueError, match="prev: must be 16 bytes"):
        impl.hash_pages(key, [1, 2], 1, bytes(17))
    with pytest.raises(ValueError, match="prev: must be 16 bytes"):
        impl.hash_page(key, b"", [1])
    with pytest.raises(ValueError, match="secret: must be 16 bytes"):
        impl.namespace_key(b"short", "t", "m")
    with pytest.raises(ValueError, match="page_size: must be > 0"):
        impl.hash_pages(key, [1, 2], 0)
    with pytest.raises(ValueError, match=r"tokens\[1\].*outside int32"):
        impl.hash_pages(key, [1, 2**31], 1)
    with pytest.raises(ValueError, match=r"tokens\[0\].*outside int32"):
        impl.hash_pages(key, array.array("q", [-(2**31) - 1]), 1)
    with pytest.raises(ValueError, match=r"outside int32"):
        impl.hash_pages(key, array.array("I", [2**31]), 1)
    with pytest.raises(TypeError, match=r"tokens\[2\]: expected an int, got str"):
        impl.hash_pages(key, [1, 2, "3"], 1)
    with pytest.raises(TypeError, match="tokens: buffer format 'd' is not an integer type"):
        impl.hash_pages(key, array.array("d", [1.0]), 1)
    with pytest.raises(ValueError, match="4 bytes each; got 6 bytes"):
        impl.hash_pages(key, b"\x00" * 6, 1)
    with pytest.raises(TypeError, match="tokens: expected a sequence of ints"):
        impl.hash_pages(key, 5, 1)


def test_threads_hash_concurrently_to_the_same_result() -> None:
    native = _native()
    rng = random.Random(3)
    key = rng.randbytes(16)
    tokens = array.array("i", (rng.randrange(128000) for _ in range(64 * 512)))
    expected = native.hash_pages(key, tokens, 64)
    results: list[list[bytes]] = []

    def work() -> None:
        for _ in range(20):
            results.append(native.hash_pages(key, tokens, 64))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80 and all(r == expected for r in results)


def test_front_end_functions_and_wire_form() -> None:
    v = PAGES_VECTORS[0]
    assert hashing.hash_pages(v.key, v.tokens, v.page_size) == v.hashes
    assert hashing.hash_page(v.key, hashing.ZERO_HASH, v.tokens[:4]) == v.hashes[0]
    assert hashing.key_fingerprint(NS_VECTORS[0].key) == NS_VECTORS[0].fingerprint
    ns = NS_VECTORS[4]
    assert hashing.namespace_key(ns.secret, ns.tenant, ns.model) == ns.key
    wire = hashing.encode_page_hashes(v.hashes)
    assert wire == b"".join(v.hashes) and len(wire) == 16 * len(v.hashes)
    assert hashing.decode_page_hashes(wire) == v.hashes
    with pytest.raises(ValueError, match=r"hashes\[1\]: must be 16 bytes"):
        hashing.encode_page_hashes([bytes(16), bytes(3)])
    assert hashing.ZERO_HASH == bytes(16)
    assert Path(hashing.__file__).parent.name == "hashing"


def test_bench_smoke() -> None:
    """bench/python_hash_bench.py runs and finds both backends agreeing."""
    _native()
    out = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "python_hash_bench.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "pure / extension (array('i')):" in out.stdout
