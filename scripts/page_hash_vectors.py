#!/usr/bin/env python3
"""Independent Python implementation of the kvcm page hash (docs/HASHING.md).

Writes tests/data/page_hash_vectors.txt, which the C++ tests check against. Run it again
only when the construction changes (and bump kPageHashVersion when it does).
    python3 scripts/page_hash_vectors.py > tests/data/page_hash_vectors.txt
"""
import random
import struct

MASK = (1 << 64) - 1


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & MASK


def siphash128(key: bytes, data: bytes) -> bytes:
    """SipHash-2-4 with 128-bit output, as the reference siphash.c with outlen == 16."""
    k0, k1 = struct.unpack("<QQ", key)
    v0 = 0x736F6D6570736575 ^ k0
    v1 = 0x646F72616E646F6D ^ k1 ^ 0xEE
    v2 = 0x6C7967656E657261 ^ k0
    v3 = 0x7465646279746573 ^ k1

    def rounds(n):
        nonlocal v0, v1, v2, v3
        for _ in range(n):
            v0 = (v0 + v1) & MASK; v1 = _rotl(v1, 13); v1 ^= v0; v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & MASK; v3 = _rotl(v3, 16); v3 ^= v2
            v0 = (v0 + v3) & MASK; v3 = _rotl(v3, 21); v3 ^= v0
            v2 = (v2 + v1) & MASK; v1 = _rotl(v1, 17); v1 ^= v2; v2 = _rotl(v2, 32)

    full = len(data) - len(data) % 8
    for i in range(0, full, 8):
        (m,) = struct.unpack_from("<Q", data, i)
        v3 ^= m; rounds(2); v0 ^= m
    b = (len(data) & 0xFF) << 56
    for i, byte in enumerate(data[full:]):
        b |= byte << (8 * i)
    v3 ^= b; rounds(2); v0 ^= b
    v2 ^= 0xEE; rounds(4)
    lo = v0 ^ v1 ^ v2 ^ v3
    v1 ^= 0xDD; rounds(4)
    hi = v0 ^ v1 ^ v2 ^ v3
    return struct.pack("<QQ", lo, hi)


def namespace_key(secret: bytes, tenant: str, model: str) -> bytes:
    t, m = tenant.encode(), model.encode()
    msg = b"kvcm/ns/v1" + struct.pack("<I", len(t)) + t + struct.pack("<I", len(m)) + m
    return siphash128(secret, msg)


def fingerprint(key: bytes) -> int:
    return struct.unpack("<Q", siphash128(key, b"kvcm/fingerprint/v1")[:8])[0]


def page_hashes(key: bytes, tokens, page_size):
    prev = bytes(16)
    out = []
    for p in range(len(tokens) // page_size):
        page = tokens[p * page_size:(p + 1) * page_size]
        prev = siphash128(key, prev + struct.pack("<%di" % len(page), *page))
        out.append(prev)
    return out


def main():
    # Sanity check against the SipHash reference vectors (key 00..0f, message 00..len-1).
    ref = bytes(range(16))
    assert siphash128(ref, b"").hex() == "a3817f04ba25a8e66df67214c7550293"
    assert siphash128(ref, bytes(range(9))).hex() == "264499060ad9baabc47f8b02bb6d71ed"

    rng = random.Random(20261122)
    print("# kvcm page-hash test vectors, written by scripts/page_hash_vectors.py.")
    print("# All byte strings are hex of the wire bytes (page hash: le64 lo then le64 hi).")
    print("# ns <secret> <tenant> <model> <namespace key> <key fingerprint as decimal u64>")
    print("# pages <namespace key> <page_size> <tokens, comma separated> <hash,hash,...>")
    secrets = [bytes(16), bytes(range(16)), bytes(rng.randrange(256) for _ in range(16))]
    names = [("acme", "deepseek-v3"), ("t", "m"), ("tenant-b", "llama-3-70b/instruct")]
    keys = []
    for s in secrets:
        for tenant, model in names:
            k = namespace_key(s, tenant, model)
            keys.append(k)
            print("ns", s.hex(), tenant, model, k.hex(), fingerprint(k))
    cases = [(keys[0], 4, list(range(12))),
             (keys[1], 1, [0, -1, 2147483647, -2147483648]),
             (keys[4], 3, [7, 7, 7, 7, 7, 7, 7]),  # odd page size, trailing partial page
             (keys[8], 64, [rng.randrange(0, 128000) for _ in range(64 * 3 + 5)])]
    for key, page_size, tokens in cases:
        hashes = page_hashes(key, tokens, page_size)
        print("pages", key.hex(), page_size, ",".join(map(str, tokens)),
              ",".join(h.hex() for h in hashes))


if __name__ == "__main__":
    main()
