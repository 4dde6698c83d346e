"""Pure-Python kvcm page hash (docs/HASHING.md): the fallback of the C++ extension.

Same API and errors as kvcm._pagehash; about 1000 times slower. Used when the extension is
not built, or when KVCM_PURE_PYTHON_HASH=1.
"""

from __future__ import annotations

import struct
import sys
from typing import Any, List, Sequence, Tuple

ZERO_HASH = bytes(16)

_MASK = (1 << 64) - 1
_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_INTEGER_FORMATS = frozenset("bhilqnBHILQN")


def _read16(value: Any, field: str) -> bytes:
    b = bytes(value)
    if len(b) != 16:
        raise ValueError(f"{field}: must be 16 bytes, got {len(b)}")
    return b


def _rounds(v0: int, v1: int, v2: int, v3: int, n: int) -> Tuple[int, int, int, int]:
    for _ in range(n):
        v0 = (v0 + v1) & _MASK
        v1 = ((v1 << 13) | (v1 >> 51)) & _MASK
        v1 ^= v0
        v0 = ((v0 << 32) | (v0 >> 32)) & _MASK
        v2 = (v2 + v3) & _MASK
        v3 = ((v3 << 16) | (v3 >> 48)) & _MASK
        v3 ^= v2
        v0 = (v0 + v3) & _MASK
        v3 = ((v3 << 21) | (v3 >> 43)) & _MASK
        v3 ^= v0
        v2 = (v2 + v1) & _MASK
        v1 = ((v1 << 17) | (v1 >> 47)) & _MASK
        v1 ^= v2
        v2 = ((v2 << 32) | (v2 >> 32)) & _MASK
    return v0, v1, v2, v3


def _sip128(k0: int, k1: int, words: Sequence[int], tail: bytes, total: int) -> bytes:
    """SipHash-2-4-128 over little-endian 64-bit `words`, then `tail` (< 8 bytes)."""
    v0 = 0x736F6D6570736575 ^ k0
    v1 = 0x646F72616E646F6D ^ k1 ^ 0xEE
    v2 = 0x6C7967656E657261 ^ k0
    v3 = 0x7465646279746573 ^ k1
    last = (total & 0xFF) << 56
    for i, byte in enumerate(tail):
        last |= byte << (8 * i)
    for m in (*words, last):
        v3 ^= m
        v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 2)
        v0 ^= m
    v2 ^= 0xEE
    v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 4)
    lo = v0 ^ v1 ^ v2 ^ v3
    v1 ^= 0xDD
    v0, v1, v2, v3 = _rounds(v0, v1, v2, v3, 4)
    return struct.pack("<QQ", lo, v0 ^ v1 ^ v2 ^ v3)


def _sip_bytes(key: bytes, data: bytes) -> bytes:
    k0, k1 = struct.unpack("<QQ", key)
    full = len(data) - len(data) % 8
    words = struct.unpack_from(f"<{full // 8}Q", data)
    return _sip128(k0, k1, words, data[full:], len(data))


def siphash128(key: bytes, data: bytes) -> bytes:
    """SipHash-2-4 with 128-bit output: 16 bytes, lo then hi little-endian."""
    return _sip_bytes(_read16(key, "key"), bytes(data))


def namespace_key(secret: bytes, tenant: str, model: str) -> bytes:
    """The namespace's hash key under the manager's secret."""
    t, m = tenant.encode(), model.encode()
    msg = b"kvcm/ns/v1" + struct.pack("<I", len(t)) + t + struct.pack("<I", len(m)) + m
    return _sip_bytes(_read16(secret, "secret"), msg)


def key_fingerprint(key: bytes) -> int:
    """Public 64-bit fingerprint of a namespace key, sent in HashScheme."""
    return struct.unpack("<Q", _sip_bytes(_read16(key, "key"), b"kvcm/fingerprint/v1")[:8])[0]


def _check_int32(values: Sequence[int]) -> None:
    for i, v in enumerate(values):
        if v < _INT32_MIN or v > _INT32_MAX:
            raise ValueError(f"tokens[{i}] = {v} is outside int32")


def token_bytes(tokens: Any) -> bytes:
    """Tokens as little-endian int32 bytes, accepting what the extension accepts."""
    try:
        view = memoryview(tokens)
    except TypeError:
        view = None
    if view is not None:
        if view.ndim > 1:
            raise TypeError(f"tokens: expected a 1-D buffer, got {view.ndim} dimensions")
        fmt = view.format.lstrip("@=<")
        if fmt in ("B", "c") and view.itemsize == 1:
            raw = view.tobytes()
            if len(raw) % 4 != 0:
                raise ValueError(
                    f"tokens: a bytes buffer holds int32 tokens, 4 bytes each; got {len(raw)} bytes"
                )
            return raw if sys.byteorder == "little" else _swap32(raw)
        if fmt not in _INTEGER_FORMATS:
            raise TypeError(f"tokens: buffer format '{view.format}' is not an integer type")
        values = view.tolist()
    else:
        try:
            values = list(tokens)
        except TypeError:
            raise TypeError("tokens: expected a sequence of ints or an int32 buffer") from None
        for i, v in enumerate(values):
            if not isinstance(v, int):
                try:
                    values[i] = v.__index__()
                except AttributeError:
                    raise TypeError(
                        f"tokens[{i}]: expected an int, got {type(v).__name__}"
                    ) from None
    try:
        return struct.pack(f"<{len(values)}i", *values)
    except struct.error:
        _check_int32(values)
        raise


def _swap32(raw: bytes) -> bytes:
    n = len(raw) // 4
    return struct.pack(f"<{n}i", *struct.unpack(f"={n}i", raw))


def _hash_page_bytes(k0: int, k1: int, prev: bytes, page: bytes) -> bytes:
    data = prev + page
    full = len(data) - len(data) % 8
    words = struct.unpack_from(f"<{full // 8}Q", data)
    return _sip128(k0, k1, words, data[full:], len(data))


def hash_page(key: bytes, prev: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one page of tokens chained to `prev` (the previous page's hash)."""
    k0, k1 = struct.unpack("<QQ", _read16(key, "key"))
    prev = _read16(prev, "prev")
    return _hash_page_bytes(k0, k1, prev, token_bytes(tokens))


def hash_pages(key: bytes, tokens: Any, page_size: int, prev: bytes = ZERO_HASH) -> List[bytes]:
    """Chained hashes of the whole pages of `tokens`, the first chained to `prev`."""
    k0, k1 = struct.unpack("<QQ", _read16(key, "key"))
    prev = _read16(prev, "prev")
    if page_size <= 0:
        raise ValueError(f"page_size: must be > 0, got {page_size}")
    raw = token_bytes(tokens)
    step = 4 * page_size
    out = []
    for start in range(0, len(raw) - step + 1, step):
        prev = _hash_page_bytes(k0, k1, prev, raw[start : start + step])
        out.append(prev)
    return out
