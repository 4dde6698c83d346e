#!/usr/bin/env python3
"""Times kvcm.hashing.hash_pages: the C++ extension next to the pure-Python fallback.

    build/pyenv/bin/python bench/python_hash_bench.py            # 128K tokens, page 64
    build/pyenv/bin/python bench/python_hash_bench.py --smoke    # a quick run (tests)

Needs the kvcm package installed (pip install ./client/python). Reports the median of
--repeat runs per token container, and the pure / extension ratio on the same prompt.
"""

from __future__ import annotations

import argparse
import array
import random
import statistics
import sys
import time
from typing import Any, Callable, List


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128 * 1024, help="prompt length")
    parser.add_argument("--page_size", type=int, default=64, help="tokens per page")
    parser.add_argument("--repeat", type=int, default=50, help="runs per extension case")
    parser.add_argument("--pure_repeat", type=int, default=3, help="runs of the pure-Python one")
    parser.add_argument("--smoke", action="store_true", help="8K tokens, few runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.repeat, args.pure_repeat = 8 * 1024, 5, 1

    from kvcm import hashing
    from kvcm.hashing import pure

    if hashing.native is None:
        print("kvcm._pagehash is not built (or KVCM_PURE_PYTHON_HASH=1)", file=sys.stderr)
        return 1
    native = hashing.native
    rng = random.Random(1)
    key = rng.randbytes(16)
    as_list = [rng.randrange(128000) for _ in range(args.tokens)]
    as_array = array.array("i", as_list)
    containers = {"list[int]": as_list, "array('i')": as_array, "bytes (int32)": as_array.tobytes()}
    try:
        import numpy as np

        containers["numpy int32"] = np.array(as_list, dtype=np.int32)
        containers["numpy int64"] = np.array(as_list, dtype=np.int64)
    except ImportError:
        pass

    pages = args.tokens // args.page_size
    print(f"hash_pages: {args.tokens} tokens, page size {args.page_size} ({pages} pages)")
    expected = pure.hash_pages(key, as_array, args.page_size)
    pure_ms = median_ms(lambda: pure.hash_pages(key, as_array, args.page_size), args.pure_repeat)
    ext_ms = {}
    for name, tokens in containers.items():
        if native.hash_pages(key, tokens, args.page_size) != expected:
            print(f"extension and pure Python disagree on {name}", file=sys.stderr)
            return 1
        ext_ms[name] = median_ms(
            lambda t=tokens: native.hash_pages(key, t, args.page_size), args.repeat
        )
        print(f"  extension, {name:14s} {ext_ms[name]:9.3f} ms")
    print(f"  pure Python, array('i')    {pure_ms:9.1f} ms")
    ratio = pure_ms / ext_ms["array('i')"]
    print(f"pure / extension (array('i')): {ratio:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
