"""kvcm: Python client of the kvcm KV-cache prefix manager.

    import kvcm
    client = kvcm.Client("127.0.0.1:50051", insecure=True)
    ns = kvcm.Namespace("acme", "deepseek-v3")
    client.register_model(ns, kvcm.ModelSpec.deepseek_v3())
    with client.match_and_pin(ns, tokens) as prefix:
        print(prefix.match.matched_tokens, prefix.match.pages)

kvcm.aio.Client is the asyncio twin; kvcm.hashing the page hash.
"""

from kvcm import hashing
from kvcm._options import ClientOptions
from kvcm.client import Client, EventStream, PinnedPrefix
from kvcm.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvcmError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from kvcm.types import *  # noqa: F401,F403  (its __all__: the result and spec types)

from kvcm import aio, types  # noqa: E402  (after Client: kvcm.aio imports kvcm.client)

__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "Client",
    "ClientOptions",
    "DataLoss",
    "DeadlineExceeded",
    "EventStream",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "KvcmError",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "PinnedPrefix",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "aio",
    "hashing",
    *types.__all__,
]
