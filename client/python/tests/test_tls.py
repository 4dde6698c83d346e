"""kvcm.Client over mutual TLS with bearer tokens (README "TLS and tokens")."""

from __future__ import annotations

import hashlib
import secrets
import subprocess
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest

import kvcm
import kvcm.aio
from conftest import REPO_ROOT, Manager, prompt, require_or_skip

NS = kvcm.Namespace("acme", "deepseek-v3")
GPU0 = kvcm.PoolRef("gpu-0")


@pytest.fixture
def secured(manager_factory, workdir: Path) -> Iterator[Tuple[Manager, Path, Dict[str, Path]]]:
    """A manager serving mutual TLS with a tokens file; yields it, the certs dir and the
    token file of each principal (acme and globex workers, ops admin)."""
    certs = workdir / "certs"
    try:
        subprocess.run(
            [str(REPO_ROOT / "scripts" / "make_test_certs.sh"), str(certs)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        require_or_skip(f"scripts/make_test_certs.sh failed: {e}")
    tokens: Dict[str, Path] = {}
    lines = []
    for who, roles in (
        ("acme", "roles=worker tenant=acme"),
        ("globex", "roles=worker tenant=globex"),
        ("ops", "roles=admin"),
    ):
        token = secrets.token_hex(32)
        tokens[who] = workdir / f"{who}.token"
        tokens[who].write_text(token + "\n")
        lines.append(f"{hashlib.sha256(token.encode()).hexdigest()} {who} {roles}\n")
    (workdir / "tokens").write_text("".join(lines))
    manager = manager_factory(
        f"--tls_cert_file={certs / 'manager.pem'}",
        f"--tls_key_file={certs / 'manager.key'}",
        f"--tls_ca_file={certs / 'ca.pem'}",
        f"--tokens_file={workdir / 'tokens'}",
        insecure=False,
    ).start()
    yield manager, certs, tokens


def tls_client(manager: Manager, certs: Path, **kwargs) -> kvcm.Client:
    return kvcm.Client(
        manager.address,
        tls_ca_file=str(certs / "ca.pem"),
        tls_cert_file=str(certs / "client.pem"),
        tls_key_file=str(certs / "client.key"),
        **kwargs,
    )


def test_tenants_and_roles_over_mutual_tls(secured) -> None:
    manager, certs, tokens = secured
    tokens_list = prompt(256)
    with (
        tls_client(manager, certs, token_file=str(tokens["acme"])) as acme,
        tls_client(manager, certs, token_file=str(tokens["ops"])) as ops,
        tls_client(manager, certs, token_file=str(tokens["globex"])) as globex,
    ):
        acme.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        # Only an admin creates an index-only pool (no agent here).
        with pytest.raises(kvcm.NotFound, match="only an admin's Insert creates"):
            acme.insert(NS, tokens_list, GPU0, range(4))
        ops.insert(NS, tokens_list, GPU0, range(4))
        with acme.match_and_pin(NS, tokens_list) as prefix:
            assert prefix.match.matched_pages == 4
            assert acme.stats().active_pins == 1
        assert [n.namespace for n in acme.stats().namespaces] == [NS]

        # Another tenant can neither probe acme's prefix nor see it.
        with pytest.raises(kvcm.PermissionDenied):
            globex.match(NS, tokens_list, probe=True)
        assert globex.stats().namespaces == []
        # Operator actions need the admin role; refusals change nothing.
        with pytest.raises(kvcm.PermissionDenied):
            acme.evict_from_pool(GPU0, 1)
        with pytest.raises(kvcm.PermissionDenied):
            acme.delete_namespace(NS)
        assert ops.stats().pool(GPU0).pages == 4
        assert ops.delete_namespace(NS).removed_pages == 4


def test_missing_or_unknown_token_is_unauthenticated(secured, monkeypatch) -> None:
    manager, certs, tokens = secured
    with tls_client(manager, certs) as anonymous:
        with pytest.raises(kvcm.Unauthenticated):
            anonymous.stats()
    with tls_client(manager, certs, token="not-a-known-token-0123456789") as stranger:
        with pytest.raises(kvcm.Unauthenticated):
            stranger.stats()
    monkeypatch.setenv("KVCM_TOKEN", tokens["ops"].read_text().strip())
    with tls_client(manager, certs) as from_env:
        assert from_env.stats().policy == "select"  # the manager's default


@pytest.mark.asyncio
async def test_async_client_over_tls(secured) -> None:
    manager, certs, tokens = secured
    async with kvcm.aio.Client(
        manager.address,
        tls_ca_file=str(certs / "ca.pem"),
        tls_cert_file=str(certs / "client.pem"),
        tls_key_file=str(certs / "client.key"),
        token_file=str(tokens["acme"]),
    ) as acme:
        reply = await acme.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        assert reply.created
        assert (await acme.match(NS, prompt(128), probe=True)).matched_pages == 0


def test_plaintext_and_certificate_less_clients_are_refused(secured) -> None:
    manager, certs, tokens = secured
    token = str(tokens["ops"])
    with kvcm.Client(manager.address, insecure=True, token_file=token, max_attempts=2) as plain:
        with pytest.raises(kvcm.Unavailable):
            plain.stats(deadline_ms=2000)
    # Mutual TLS: a client without a certificate is refused in the handshake.
    with kvcm.Client(
        manager.address, tls_ca_file=str(certs / "ca.pem"), token_file=token, max_attempts=2
    ) as no_cert:
        with pytest.raises(kvcm.Unavailable):
            no_cert.stats(deadline_ms=2000)
    # A server certificate from a CA this client does not trust.
    with kvcm.Client(
        manager.address,
        tls_ca_file=str(certs / "untrusted-ca.pem"),
        tls_cert_file=str(certs / "client.pem"),
        tls_key_file=str(certs / "client.key"),
        token_file=token,
        max_attempts=2,
    ) as wrong_ca:
        with pytest.raises(kvcm.Unavailable):
            wrong_ca.stats(deadline_ms=2000)


def test_old_tls_keyword_names_still_work_with_a_warning(secured) -> None:
    manager, certs, tokens = secured
    with pytest.warns(DeprecationWarning, match="ca_file"):
        old = kvcm.Client(manager.address, ca_file=str(certs / "ca.pem"),
                          cert_file=str(certs / "client.pem"), key_file=str(certs / "client.key"),
                          token_file=str(tokens["ops"]))
    with old:
        assert old.options.tls_ca_file.endswith("ca.pem")
        old.stats()
    # Both names at once is a mistake, named; nothing connects.
    with pytest.raises(kvcm.InvalidArgument, match="tls_ca_file: given twice"):
        kvcm.Client(manager.address, ca_file="a.pem", tls_ca_file="b.pem")
