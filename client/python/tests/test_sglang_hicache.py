"""kvcm.sglang.hicache (KvcmHiCacheStorage) inside SGLang's own code (PyPI sglang 0.5.23,
scripts/sglang_env.sh): SGLang's StorageBackendFactory builds it for `dynamic`, SGLang's host
KV pools and HiCacheController storage paths move pages through it, SGLang's page keys name
them, and its failure injector wraps it; a real kvcm-manager and four kvcm-agents (host
pools: "a" and "b" MHA, "mla" an MLA latent pool, "small" an MHA pool of SMALL_PAGES pages
that the full-pool scenario overfills) hold the pages; a second manager and two agents ("sa",
"sb") serve mutual TLS and check bearer tokens, for the backend's TLS and token options.

The scenarios run in SGLang's environment ($KVCM_SGLANG_PYTHON, which imports the kvcm package
under test from a PYTHONPATH holding only it) as one process (rigs/sglang_hicache_driver.py; SGLang
takes ~20 s to import); each test here checks one scenario's outcome and the cluster's state.
Without $KVCM_SGLANG_PYTHON or the binaries the module skips, unless KVCM_REQUIRE_SGLANG=1.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

import kvcm

from conftest import REPO_ROOT, Process, kvcm_pythonpath, wait_registered
from conftest import scrape_metric as metric
from rigs.manager import ManagerProcess, free_port

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).resolve().parent
TENANT = "acme"
MODEL = "tiny"
PAGE = 4
MHA = {"layers": 2, "heads": 2, "head_dim": 64}
MLA = {"layers": 3, "kv_lora_rank": 512, "rope_dim": 64}


def sglang_test_path(env: str, what: str) -> str:
    """The executable in $env, or skip (fail under KVCM_REQUIRE_SGLANG=1). ctest's run sets
    KVCM_SGLANG_SKIP_CODE=77: a skip then ends the session with that code (ctest: skipped)."""
    path = os.environ.get(env, "")
    if path and os.access(path, os.X_OK):
        return path
    reason = f"{what} not found (${env}; scripts/sglang_env.sh makes it)"
    if os.environ.get("KVCM_REQUIRE_SGLANG") == "1":
        pytest.fail(f"{reason} (KVCM_REQUIRE_SGLANG=1)")
    if os.environ.get("KVCM_SGLANG_SKIP_CODE"):
        pytest.exit(f"skipped: {reason}", returncode=int(os.environ["KVCM_SGLANG_SKIP_CODE"]))
    pytest.skip(reason)


# Agent "small": a pool of SMALL_PAGES MHA pages, a fraction of what full_pool stores.
SMALL_PAGES = 8


def agent_args(agent_bin: str, agent_id: str, manager: str, port: int, geometry: list,
               capacity_bytes: int = 8 << 20, extra: tuple = (), insecure: bool = True) -> list:
    return [agent_bin, *(["--insecure"] if insecure else []), f"--agent_id={agent_id}",
            f"--manager_address={manager}",
            f"--listen_address=127.0.0.1:{port}", "--use_device=false", "--tier=host",
            "--model=", *geometry, "--kv_dtype=bf16", f"--page_size_tokens={PAGE}",
            f"--capacity_bytes={capacity_bytes}", "--heartbeat_interval_ms=200", *extra]


def mha_page_bytes() -> int:
    return 2 * MHA["layers"] * MHA["heads"] * MHA["head_dim"] * PAGE * 2


MHA_FLAGS = ["--attention=mha", f"--num_layers={MHA['layers']}", f"--num_heads={MHA['heads']}",
             f"--num_kv_heads={MHA['heads']}", f"--head_dim={MHA['head_dim']}"]
# The secured cluster's principals: token file name -> tokens-file grants ("wrong" is a token
# nobody granted).
SECURE_GRANTS = {"acme": "sglang-acme roles=worker tenant=acme",
                 "globex": "sglang-globex roles=worker tenant=globex",
                 "sa": "sa roles=agent agent=sa", "sb": "sb roles=agent agent=sb",
                 "ops": "ops roles=admin"}


def start_secure_cluster(workdir: Path, manager_bin: str, agent_bin: str, procs: list,
                         managers: list) -> dict:
    """A manager and agents sa, sb with mutual TLS (scripts/make_test_certs.sh) and a
    tokens file; returns the driver's CFG["secure"] and an admin client."""
    certs = workdir / "certs"
    subprocess.run([str(REPO_ROOT / "scripts" / "make_test_certs.sh"), str(certs), "sa", "sb"],
                   check=True, capture_output=True)
    tokens = {who: secrets.token_hex(16) for who in [*SECURE_GRANTS, "wrong"]}
    files = {}
    for who, token in tokens.items():
        files[who] = workdir / f"{who}.token"
        files[who].write_text(token + "\n")
    table = workdir / "secure-tokens"
    table.write_text("".join(f"{hashlib.sha256(tokens[w].encode()).hexdigest()} {grant}\n"
                             for w, grant in SECURE_GRANTS.items()))
    manager = ManagerProcess(manager_bin, workdir / "secure-manager",
                             tokens={tokens[w]: g for w, g in SECURE_GRANTS.items()},
                             tls=(str(certs / "manager.pem"), str(certs / "manager.key"),
                                  str(certs / "ca.pem")))
    managers.append(manager)
    manager.start()
    agents, started = {}, {}
    for agent_id in ("sa", "sb"):
        port = free_port()
        tls = (f"--tls_cert_file={certs / f'{agent_id}.pem'}",
               f"--tls_key_file={certs / f'{agent_id}.key'}", f"--tls_ca_file={certs / 'ca.pem'}",
               f"--token_file={files[agent_id]}", f"--tokens_file={table}")
        started[agent_id] = Process(agent_args(agent_bin, agent_id, manager.address, port,
                                               MHA_FLAGS, extra=tls, insecure=False),
                                    workdir / f"agent-{agent_id}.log")
        procs.append(started[agent_id])
        agents[agent_id] = f"127.0.0.1:{port}"
    tls_files = {"tls_ca_file": str(certs / "ca.pem"), "tls_cert_file": str(certs / "client.pem"),
                 "tls_key_file": str(certs / "client.key")}
    admin = kvcm.Client(manager.address, tls_ca_file=tls_files["tls_ca_file"],
                        tls_cert_file=tls_files["tls_cert_file"], tls_key_file=tls_files["tls_key_file"],
                        token_file=str(files["ops"]))
    wait_registered(admin, started)
    return {"config": {"manager": manager.address, "agents": agents, **tls_files,
                       "tokens": {w: str(f) for w, f in files.items()}},
            "client": admin}




@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    sglang_python = sglang_test_path("KVCM_SGLANG_PYTHON", "the SGLang environment's python")
    manager_bin = sglang_test_path("KVCM_MANAGER_BIN", "the kvcm-manager binary")
    agent_bin = sglang_test_path("KVCM_AGENT_BIN", "the kvcm-agent binary")
    workdir = tmp_path_factory.mktemp("sglang-hicache")
    pythonpath = kvcm_pythonpath(workdir)
    metrics = {"manager": f"127.0.0.1:{free_port()}", "small": f"127.0.0.1:{free_port()}"}
    manager = ManagerProcess(manager_bin, workdir / "manager",
                             flags=(f"--metrics_address={metrics['manager']}",))
    agents: dict = {}
    procs: list = []
    managers = [manager]
    client = secure = None
    try:
        manager.start()
        mha = MHA_FLAGS
        mla = ["--attention=mla", f"--num_layers={MLA['layers']}", "--num_heads=1",
               f"--kv_lora_rank={MLA['kv_lora_rank']}", f"--rope_dim={MLA['rope_dim']}"]
        started = {}
        for agent_id, geometry in (("a", mha), ("b", mha), ("mla", mla), ("small", mha)):
            port = free_port()
            size = {}
            if agent_id == "small":
                size = {"capacity_bytes": SMALL_PAGES * mha_page_bytes(),
                        "extra": (f"--metrics_address={metrics['small']}",)}
            started[agent_id] = Process(agent_args(agent_bin, agent_id, manager.address, port,
                                                   geometry, **size),
                                        workdir / f"agent-{agent_id}.log")
            procs.append(started[agent_id])
            agents[agent_id] = f"127.0.0.1:{port}"
        client = kvcm.Client(manager.address, insecure=True)
        wait_registered(client, started)
        secure = start_secure_cluster(workdir, manager_bin, agent_bin, procs, managers)
        config = {"manager": manager.address, "agents": agents, "tenant": TENANT,
                  "model": MODEL, "page_size": PAGE, "mha": MHA, "mla": MLA,
                  "secure": secure["config"]}
        (workdir / "config.json").write_text(json.dumps(config))
        env = dict(os.environ, PYTHONPATH=str(pythonpath))
        run = subprocess.run([sglang_python, str(HERE / "rigs" / "sglang_hicache_driver.py"),
                              str(workdir / "config.json"), str(workdir / "results.json")],
                             env=env, capture_output=True, text=True, timeout=500)
        if run.returncode != 0 or not (workdir / "results.json").exists():
            pytest.fail(f"the SGLang driver failed ({run.returncode}):\n{run.stdout[-3000:]}\n"
                        f"{run.stderr[-6000:]}")
        results = json.loads((workdir / "results.json").read_text())
        yield {"results": results, "client": client, "log": run.stderr, "metrics": metrics,
               "secure_client": secure["client"]}
    finally:
        for c in (client, secure and secure["client"]):
            if c:
                c.close()
        for p in procs:
            p.stop()
        for m in managers:
            m.stop()


def outcome(cluster: dict, name: str) -> dict:
    result = cluster["results"][name]
    assert result["ok"], f"{name} in SGLang's process:\n{result['error']}"
    return result


def namespace_stats(cluster: dict, ns: list) -> kvcm.NamespaceStats:
    stats = cluster["client"].stats()
    return next(n for n in stats.namespaces if [n.namespace.tenant, n.namespace.model] == ns)


def test_factory_round_trip_between_two_agents(cluster) -> None:
    r = outcome(cluster, "factory_round_trip")
    # SGLang's keys are SHA-256 chains (64 hex digits), one per page.
    assert len(r["keys"]) == 5 and all(len(k) == 64 for k in r["keys"])
    assert r["namespace"] == [TENANT, f"{MODEL}/sglang-page_first"]
    ns = namespace_stats(cluster, r["namespace"])
    assert ns.spec.attention == kvcm.AttentionKind.MHA
    assert ns.bytes_per_page == 2 * MHA["layers"] * MHA["heads"] * MHA["head_dim"] * PAGE * 2
    # Engine B's fetch made a second replica of every page (on agent b).
    assert r["counters_b"]["fetched_pages"] == 5 and r["counters_b"]["errors"] == 0


def test_zero_copy_interface_v1(cluster) -> None:
    outcome(cluster, "interface_v1")


def test_sglang_unit_test_adapted(cluster) -> None:
    outcome(cluster, "sglang_unit_test_adapted")


def test_failure_injector(cluster) -> None:
    r = outcome(cluster, "failure_injector")
    print("under 30% injected failures:", r["stored_pages"], "pages stored,",
          r["fetched_pages"], "fetched")


def test_wrong_page_size_is_refused_and_changes_nothing(cluster) -> None:
    r = outcome(cluster, "wrong_page_size")
    assert r["counters"]["refused_page_size"] == 3


def test_other_tenant_gets_nothing(cluster) -> None:
    r = outcome(cluster, "other_tenant")
    assert r["namespace_b"][0] == "intruder"
    assert r["counters_b"]["fetched_pages"] == 0 and r["counters_b"]["local_hits"] == 0
    # The intruder's namespace holds no page.
    assert namespace_stats(cluster, r["namespace_b"]).pages == 0


def test_layouts_apart_and_threads_at_once(cluster) -> None:
    r = outcome(cluster, "layouts_and_threads")
    assert r["namespace"] == [TENANT, f"{MODEL}/sglang-layer_first"]


def test_mla_latent_pages_cost_their_bytes(cluster) -> None:
    r = outcome(cluster, "mla_latent_pages")
    want = (MLA["kv_lora_rank"] + MLA["rope_dim"]) * MLA["layers"] * PAGE * 2
    assert r["bytes_per_page"] == want
    assert r["used_bytes_delta"] == 2 * want
    ns = namespace_stats(cluster, r["namespace"])
    assert ns.spec.attention == kvcm.AttentionKind.MLA and ns.bytes_per_page == want
    assert ns.pages == 2


def test_a_full_pool_keeps_storing_and_lookups_hit_what_it_kept(cluster) -> None:
    r = outcome(cluster, "full_pool")
    stored = r["stored_per_prompt"]
    print("pages stored per backup:", stored, "| held after them:", r["held_after_first_pass"],
          "| second pass hits:", r["second_pass_hits"], "| counters:", r["counters"],
          "| held changed by backing up a held prompt again:", r["held_changed"])
    # Backups went on storing new pages (each prompt's own two at least) long after the
    # pool filled, and never stored a page the pool held (already_present_pages).
    assert all(n >= 2 for n in stored), stored
    assert r["counters"]["stored_pages"] > 4 * SMALL_PAGES and r["counters"]["errors"] == 0
    # Which pages the manager's default policy (select: the order of whichever candidate its
    # miniature simulations find best, some of which learn in wall-clock time) keeps is not
    # pinned down here; each lookup was
    # checked against the index in SGLang's process. The last prompt is whole, and the pool
    # cannot hold every prompt of the second pass: lookups both hit and missed.
    held = r["held_after_first_pass"]
    assert held[-1] == 3 and min(held) < 3, held
    assert 3 in r["second_pass_hits"] and min(r["second_pass_hits"]) < 3
    # Every page stored and no longer held was evicted for an allocation of agent small;
    # the agent's free blocks are those the index does not hold (none leaked).
    m, a = cluster["metrics"]["manager"], cluster["metrics"]["small"]
    stats = cluster["client"].stats()
    pool = next(p for p in stats.pools if p.pool.agent_id == "small")
    agent = next(x for x in stats.agents if x.agent_id == "small")
    evicted = metric(m, "kvcm_allocation_evicted_pages_total")
    print(f"evicted {evicted:.0f} pages, room made "
          f"{metric(m, 'kvcm_allocation_room_total'):.0f} times; {pool.pages} pages held")
    assert pool.pages <= SMALL_PAGES
    assert evicted == r["counters"]["stored_pages"] - pool.pages > 0
    assert metric(a, "kvcm_agent_room_evicted_pages_total") == evicted
    assert metric(m, "kvcm_allocation_room_total") > 0
    assert metric(a, "kvcm_agent_room_allocations_total") > 0
    assert metric(m, "kvcm_allocation_room_refusals_total") == 0
    assert metric(a, "kvcm_agent_allocation_failures_total") == 0
    assert agent.free_blocks == SMALL_PAGES - pool.pages
    assert namespace_stats(cluster, r["namespace"]).pages == pool.pages


def test_mutual_tls_and_tokens_round_trip(cluster) -> None:
    r = outcome(cluster, "tls_tokens_round_trip")
    assert r["namespace"] == [TENANT, f"{MODEL}/sglang-page_first"]
    assert r["counters_a"]["stored_pages"] == 3 and r["counters_a"]["errors"] == 0
    assert r["counters_b"]["fetched_pages"] == 3 and r["counters_b"]["errors"] == 0
    # Both secured agents hold the 3 pages: stored on sa, fetched into sb.
    stats = cluster["secure_client"].stats()
    assert {p.pool.agent_id: p.pages for p in stats.pools} == {"sa": 3, "sb": 3}


def test_a_missing_unknown_or_foreign_token_is_refused_and_stores_nothing(cluster) -> None:
    r = outcome(cluster, "tls_tokens_refused")
    errors = r["errors"]
    print("refusals:", json.dumps(errors, indent=1))
    for who in ("None", "wrong"):
        assert "refused this engine's credentials" in errors[who], errors[who]
        assert "UNAUTHENTICATED" in errors[who] and "token_file" in errors[who], errors[who]
    assert "(no token)" in errors["None"]
    assert "wrong.token" in errors["wrong"]
    assert "PERMISSION_DENIED" in errors["globex"] and "tenant acme" in errors["globex"]
    # Nothing but the round trip's pages in the secured cluster; globex has no namespace.
    stats = cluster["secure_client"].stats()
    assert [(n.namespace.tenant, n.pages) for n in stats.namespaces] == [(TENANT, 3)]
    assert sum(p.pages for p in stats.pools) == 6


def test_every_pin_was_released(cluster) -> None:
    """Each get pins its page (Match pin=True) for the read and releases it after."""
    for name in cluster["results"]:
        outcome(cluster, name)
    assert cluster["client"].stats().active_pins == 0
    assert cluster["secure_client"].stats().active_pins == 0
