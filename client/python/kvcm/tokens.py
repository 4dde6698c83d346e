"""kvcm tokens files, read as the manager reads `--tokens_file` (common/token_table.h).

One principal a line: the SHA-256 of its bearer token (64 hex digits), a name, then
`roles=worker,router,agent,engine,admin` and their scope (`tenant=`, `tenants=`, `agent=`,
`engine=`); `#` starts a comment. The file holds hashes only. `TokenTable.parse` refuses
what the manager refuses, naming the line. Immutable once parsed; safe to share.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Tuple

ROLES = ("worker", "router", "agent", "admin", "engine")
# The manager refuses shorter tokens whatever the file says.
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_HEX64 = re.compile(r"^[0-9A-Fa-f]{64}$")


class TokensFileError(ValueError):
    """A tokens file that does not parse; the message names the file and line."""


@dataclass(frozen=True)
class Principal:
    name: str
    roles: FrozenSet[str]
    tenant: str = ""                         # worker, engine
    router_tenants: Tuple[str, ...] = ()     # router; "*" for every tenant
    agent_id: str = ""
    engine_id: str = ""

    def has(self, role: str) -> bool:
        return role in self.roles

    def is_worker_of(self, tenant: str) -> bool:
        return self.has("worker") and self.tenant == tenant


def bearer_token(authorization: Optional[str]) -> str:
    """The token of an `Authorization: Bearer <token>` value; ValueError saying what is wrong
    (the manager's BearerToken rule)."""
    if not authorization:
        raise ValueError("no Authorization header (send \"Authorization: Bearer <token>\")")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        raise ValueError("Authorization is not \"Bearer <token>\"")
    token = token.strip()
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ValueError(f"bearer token must be {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} "
                         "characters")
    if any(not ("!" <= c <= "~") for c in token):
        raise ValueError("bearer token must be visible ASCII")
    return token


@dataclass
class TokenTable:
    by_hash: Dict[bytes, Principal] = field(default_factory=dict)

    def find(self, token: str) -> Optional[Principal]:
        """The principal `token` names; None for an unknown token."""
        return self.by_hash.get(hashlib.sha256(token.encode("ascii", "replace")).digest())

    @staticmethod
    def parse(text: str, source: str) -> "TokenTable":
        table = TokenTable()
        names = set()
        for line_no, line in enumerate(text.split("\n"), 1):
            def bad(what: str) -> TokensFileError:
                return TokensFileError(f"{source}:{line_no}: {what}")

            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) < 3:
                raise bad("expected `<sha256 hex> <name> roles=... [key=value ...]`")
            if not _HEX64.match(fields[0]):
                raise bad("the first field must be the token's SHA-256, 64 hex digits")
            digest = bytes.fromhex(fields[0])
            if digest in table.by_hash:
                raise bad("this token hash appears twice")
            name = fields[1]
            if not _ID.match(name):
                raise bad(f'bad principal name "{name}"')
            if name in names:
                raise bad(f'principal name "{name}" appears twice')
            names.add(name)
            kw: Dict[str, str] = {}
            roles: set = set()
            tenants: Tuple[str, ...] = ()
            for f in fields[2:]:
                key, _, value = f.partition("=")
                if not value:
                    raise bad(f'"{f}" is not key=value')
                if key == "roles":
                    for r in value.split(","):
                        if r not in ROLES:
                            raise bad(f'unknown role "{r}" (worker, router, agent, engine, '
                                      'admin)')
                        roles.add(r)
                elif key == "tenants":
                    tenants = tuple(value.split(","))
                    for t in tenants:
                        if t != "*" and not _ID.match(t):
                            raise bad(f'bad tenant "{t}" in tenants=')
                elif key in ("tenant", "agent", "engine"):
                    if not _ID.match(value):
                        raise bad(f'bad {key}{" id" if key != "tenant" else ""} "{value}"')
                    kw[key] = value
                else:
                    raise bad(f'unknown key "{key}" (roles, tenant, tenants, agent, engine)')
            if not roles:
                raise bad("roles= is required")
            if "worker" in roles and "tenant" not in kw:
                raise bad("role worker needs tenant=")
            if "router" in roles and not tenants:
                raise bad("role router needs tenants= (a list, or *)")
            if "agent" in roles and "agent" not in kw:
                raise bad("role agent needs agent=")
            if "engine" in roles and ("engine" not in kw or "tenant" not in kw):
                raise bad("role engine needs engine= and tenant=")
            if tenants and "router" not in roles:
                raise bad("tenants= is for role router")
            table.by_hash[digest] = Principal(
                name, frozenset(roles), tenant=kw.get("tenant", ""), router_tenants=tenants,
                agent_id=kw.get("agent", ""), engine_id=kw.get("engine", ""))
        if not table.by_hash:
            raise TokensFileError(f"{source}: no principal (an empty tokens file would lock "
                                  "every caller out)")
        return table

    @staticmethod
    def load(path: str) -> "TokenTable":
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return TokenTable.parse(f.read(), path)
        except OSError as e:
            raise TokensFileError(f"cannot read tokens file {path}: {e.strerror}") from None


__all__ = ["MIN_TOKEN_CHARS", "Principal", "TokenTable", "TokensFileError", "bearer_token"]
