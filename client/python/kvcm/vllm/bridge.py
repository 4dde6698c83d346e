"""`kvcm-vllm-bridge` and `python -m kvcm.vllm.bridge`: kvcm-bridge under its first name."""

import sys

from kvcm.engines.bridge import Bridge, EngineBridge, main

__all__ = ["Bridge", "EngineBridge", "main"]

if __name__ == "__main__":
    sys.exit(main())
