"""kvcm: Python client of the kvcm KV-cache prefix manager."""

__version__ = "0.1.0"
