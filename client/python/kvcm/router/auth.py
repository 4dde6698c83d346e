"""kvcm-router's client authentication: bearer tokens from a tokens file in the manager's
format (kvcm.tokens), checked before a request is read or routed.

A request may be sent by a worker of the router's tenant (`roles=worker tenant=T`, T the
router's namespace tenant; any tenant when the router names none) or by an admin. Its
tenant is its token's, never a header or field of the request. The file is re-read when it
changes (checked at most once a second); a file that no longer parses is logged and the
previous tokens stay. Use from one event loop.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional, Tuple

from kvcm.tokens import Principal, TokenTable, TokensFileError, bearer_token

log = logging.getLogger("kvcm.router.auth")

_RECHECK_S = 1.0


@dataclass(frozen=True)
class Refusal:
    status: int   # 401 (no or unknown token) or 403 (a known token without the grant)
    reason: str   # metric label: missing, malformed, unknown, role, tenant
    message: str


class ClientAuth:
    def __init__(self, tokens_file: str, tenant: str) -> None:
        """Raises TokensFileError when the file cannot be read or parsed (at start)."""
        self.path, self.tenant = tokens_file, tenant
        self._table = TokenTable.load(tokens_file)
        self._stamp = self._file_stamp()
        self._next_check = time.monotonic() + _RECHECK_S

    def _file_stamp(self) -> Optional[Tuple[int, int, int]]:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _RECHECK_S
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._table = TokenTable.load(self.path)
            log.info("tokens file %s re-read: %d principals", self.path,
                     len(self._table.by_hash))
        except TokensFileError as e:
            log.error("tokens file %s no longer parses (%s); the previous tokens stay",
                      self.path, e)

    def check(self, authorization: Optional[str]) -> Tuple[Optional[Principal], Optional[str],
                                                            Optional[Refusal]]:
        """(principal, its tenant, None), or (None, None, why it is refused)."""
        self._maybe_reload()
        try:
            token = bearer_token(authorization)
        except ValueError as e:
            reason = "missing" if not authorization else "malformed"
            return None, None, Refusal(401, reason, str(e))
        p = self._table.find(token)
        if p is None:
            return None, None, Refusal(401, "unknown", "unknown bearer token")
        if p.has("worker"):
            if self.tenant and p.tenant != self.tenant:
                return None, None, Refusal(
                    403, "tenant", f"principal {p.name} is a worker of tenant {p.tenant}; "
                    f"this router serves tenant {self.tenant}")
            return p, p.tenant, None
        if p.has("admin"):
            return p, self.tenant, None
        return None, None, Refusal(
            403, "role", f"principal {p.name} ({','.join(sorted(p.roles))}) may not send "
            "requests: a worker token of the router's tenant or an admin token may")


__all__ = ["ClientAuth", "Refusal", "TokensFileError"]
