"""The kvcm page hash (docs/HASHING.md), as the manager computes it.

    h_{-1} = ZERO_HASH
    h_i    = SipHash128(key_ns, h_{i-1} || le32(tokens of page i))

Every function runs in the C++ extension kvcm._pagehash (compiled from the manager's own
common/page_hash_core.h; releases the GIL while hashing) when it is importable, and in
kvcm.hashing.pure otherwise, or when the environment sets KVCM_PURE_PYTHON_HASH=1 before
import. BACKEND says which ("extension" or "pure").

Tokens may be a sequence of ints or a 1-D integer buffer: array('i') and numpy int32 are
hashed in place, other integer dtypes are range-checked to int32, and bytes / bytearray are
read as little-endian int32. A value outside int32 is ValueError; a non-integer TypeError.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, List, Sequence

from kvcm.hashing import pure

ZERO_HASH: bytes = bytes(16)
PAGE_HASH_VERSION: int = 1  # HashScheme.version of this construction

try:
    if os.environ.get("KVCM_PURE_PYTHON_HASH") == "1":
        raise ImportError("KVCM_PURE_PYTHON_HASH=1")
    from kvcm import _pagehash as native
except ImportError:
    native = None  # type: ignore[assignment]

_impl: Any = native if native is not None else pure
BACKEND: str = "extension" if native is not None else "pure"


def siphash128(key: bytes, data: bytes) -> bytes:
    """SipHash-2-4 with 128-bit output: 16 bytes, lo then hi, each little-endian."""
    return _impl.siphash128(key, data)


def namespace_key(secret: bytes, tenant: str, model: str) -> bytes:
    """Hash key of namespace (tenant, model) under the manager's 16-byte secret."""
    return _impl.namespace_key(secret, tenant, model)


def key_fingerprint(key: bytes) -> int:
    """Public 64-bit fingerprint of a namespace key (HashScheme.key_fingerprint)."""
    return _impl.key_fingerprint(key)


def hash_page(key: bytes, prev: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one page of tokens chained to `prev`, the previous page's hash."""
    return _impl.hash_page(key, prev, tokens)


def hash_pages(key: bytes, tokens: Any, page_size: int, prev: bytes = ZERO_HASH) -> List[bytes]:
    """Chained hashes of every whole page of `tokens`; a trailing partial page is ignored.

    `prev` continues a chain: hash_pages(k, t[:n*P], P) + hash_pages(k, t[n*P:], P, prev=last)
    equals hash_pages(k, t, P).
    """
    return _impl.hash_pages(key, tokens, page_size, prev)


def encode_page_hashes(hashes: Iterable[bytes]) -> bytes:
    """Wire form of page hashes (Prompt.page_hashes): their 16-byte values concatenated."""
    hashes = list(hashes)
    for i, h in enumerate(hashes):
        if len(h) != 16:
            raise ValueError(f"hashes[{i}]: must be 16 bytes, got {len(h)}")
    return b"".join(hashes)


def decode_page_hashes(data: bytes) -> List[bytes]:
    """Splits wire-form page hashes into 16-byte values."""
    if len(data) % 16 != 0:
        raise ValueError(f"page hashes: length must be a multiple of 16, got {len(data)}")
    return [bytes(data[i : i + 16]) for i in range(0, len(data), 16)]


__all__ = [
    "BACKEND",
    "PAGE_HASH_VERSION",
    "ZERO_HASH",
    "decode_page_hashes",
    "encode_page_hashes",
    "hash_page",
    "hash_pages",
    "key_fingerprint",
    "namespace_key",
    "native",
    "pure",
    "siphash128",
]
