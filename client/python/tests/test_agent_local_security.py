"""The local data path against a co-located engine (issue 35): each attack against a real
kvcm-agent process with --local_socket, from other processes. A connection that sends no
hello is closed at the deadline; one uid holds at most its share of the sessions; a peer
whose uid is not admitted is closed as accepted; a session whose token was revoked is
refused its next copy and closed; a sparse memfd is refused and an accepted one can no
longer have holes punched in it; and a process of the agent's own uid cannot read the
agent's memory through /proc (the agent is not dumpable)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, List, Optional

import grpc
import pytest

import kvcm
from conftest import Process, binary
from kvcm._proto.v1 import agent_pb2, agent_pb2_grpc, local_pb2
from kvcm.agent_local import LocalRegion

NS = kvcm.Namespace("acme", "deepseek-v3")
ENGINE_BLOCKS = 2
NOBODY = 65534


class Agent:
    def __init__(self, proc: Process, socket_path: str, address: str, token: str) -> None:
        self.proc = proc
        self.socket_path = socket_path
        self.channel = grpc.insecure_channel(address)
        self.stub = agent_pb2_grpc.BlockAgentStub(self.channel)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        stats = self.stub.Stats(agent_pb2.BlockAgentStatsRequest(), timeout=5, metadata=metadata)
        self.epoch = stats.epoch
        self.layers = stats.geometry.spec.num_layers
        self.bytes_per_block = stats.geometry.bytes_per_block

    def region(self, token: str = "") -> LocalRegion:
        seg = self.bytes_per_block // self.layers
        return LocalRegion(self.socket_path, self.layers * ENGINE_BLOCKS * seg,
                           segment_offsets=[l * ENGINE_BLOCKS * seg for l in range(self.layers)],
                           segment_bytes=seg, segment_stride=seg,
                           num_engine_blocks=ENGINE_BLOCKS, token=token, timeout_s=10)

    def allocate(self, count: int, token: str = ""):
        req = agent_pb2.AllocateBlocksRequest(count=count, owner_epoch=self.epoch)
        req.namespace.tenant, req.namespace.model = NS.tenant, NS.model
        md = [("authorization", f"Bearer {token}")] if token else []
        resp = self.stub.Allocate(req, timeout=5, metadata=md)
        return list(resp.block_ids), list(resp.block_generations)

    def log(self) -> str:
        return self.proc.log.read_text(errors="replace")


@pytest.fixture
def start_agent(manager_factory, workdir: Path) -> Iterator:
    """Starts kvcm-agents with --local_socket and extra flags; stops them after the test."""
    agent_bin = binary("KVCM_AGENT_BIN", "kvcm-agent")
    manager = manager_factory().start()
    started: List[Agent] = []

    def start(*flags: str, token: str = "") -> Agent:
        n = len(started)
        socket_path = str(workdir / f"agent{n}.sock")
        proc = Process([agent_bin, "--insecure", f"--agent_id=gpu{n}",
                        f"--manager_address={manager.address}", "--model=deepseek-v3",
                        "--capacity_bytes=100000000", "--heartbeat_interval_ms=200",
                        f"--local_socket={socket_path}", *flags], workdir / f"gpu{n}.log")
        line = proc.wait_for_log("serving BlockAgent on")
        address = line.split("serving BlockAgent on ")[1].split(" ")[0]
        deadline = time.monotonic() + 15
        while not os.path.exists(socket_path):
            assert time.monotonic() < deadline, proc.log.read_text()
            time.sleep(0.02)
        agent = Agent(proc, socket_path, address, token)
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for a in started:
            a.channel.close()
            a.proc.stop()


def raw_hello(path: str, fd: int, region_bytes: int, bytes_per_block: int):
    """A connected socket and the reply to a one-segment hello of `fd`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(path)
    req = local_pb2.LocalRequest()
    req.hello.region_bytes = region_bytes
    req.hello.segment_offsets.append(0)
    req.hello.segment_bytes = bytes_per_block
    req.hello.segment_stride = bytes_per_block
    req.hello.num_engine_blocks = region_bytes // bytes_per_block
    socket.send_fds(sock, [req.SerializeToString()], [fd])
    return sock, local_pb2.LocalReply.FromString(sock.recv(65536))


def sealed_memfd(size: int, allocate: bool) -> int:
    import fcntl

    fd = os.memfd_create("engine-kv", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def closed_by_peer(sock: socket.socket, timeout_s: float) -> Optional[float]:
    """Seconds until the peer hung up (recv returns nothing), or None."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        data = sock.recv(65536)
    except socket.timeout:
        return None
    except ConnectionResetError:
        data = b""
    return time.monotonic() - start if data == b"" else None


def test_a_connection_without_a_hello_is_closed_at_the_deadline(start_agent) -> None:
    agent = start_agent("--local_hello_timeout_ms=500", "--local_max_sessions=2")
    silent = []
    for _ in range(2):  # every slot held by a connection that never says hello
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(agent.socket_path)
        silent.append(s)
    took = [closed_by_peer(s, 5) for s in silent]
    assert all(t is not None and t < 3 for t in took), took
    agent.proc.wait_for_log("no region registered within 500 ms", 5)
    # The slots are free again, and an engine that says hello stays past the deadline.
    deadline = time.monotonic() + 5
    while True:
        try:
            region = agent.region()
            break
        except kvcm.Unavailable:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with region:
        time.sleep(0.8)
        ids, gens = agent.allocate(1)
        assert region.store(ids, [0], owner_epoch=agent.epoch, generations=gens) == 1


def test_one_uid_holds_at_most_its_share_of_the_sessions(start_agent) -> None:
    agent = start_agent("--local_max_sessions_per_uid=2")
    first, second = agent.region(), agent.region()
    with pytest.raises(kvcm.Unavailable):
        agent.region()
    agent.proc.wait_for_log(f"uid {os.geteuid()} are open (local_max_sessions_per_uid)", 5)
    first.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            third = agent.region()
            break
        except kvcm.Unavailable:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    third.close()
    second.close()


def test_a_peer_whose_uid_is_not_admitted_is_closed(start_agent) -> None:
    other = os.geteuid() + 4242
    agent = start_agent(f"--local_allowed_uids={other}")
    fd = sealed_memfd(agent.bytes_per_block, allocate=True)
    with pytest.raises(kvcm.Unavailable):
        agent.region()
    agent.proc.wait_for_log("neither its uid nor its gid is admitted", 5)
    # Its memfd never reached a session: not sealed by the agent.
    import fcntl

    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & 0x10 == 0  # F_SEAL_FUTURE_WRITE
    os.close(fd)


def test_a_revoked_tokens_session_is_refused_and_closed(start_agent, workdir: Path) -> None:
    acme, ops = secrets.token_hex(16), secrets.token_hex(16)
    table = workdir / "tokens"

    def write(lines: List[str]) -> None:
        tmp = workdir / "tokens.tmp"
        tmp.write_text("".join(lines))
        os.replace(tmp, table)

    acme_line = f"{hashlib.sha256(acme.encode()).hexdigest()} acme-vllm roles=worker tenant=acme\n"
    ops_line = f"{hashlib.sha256(ops.encode()).hexdigest()} ops roles=admin\n"
    write([acme_line, ops_line])
    agent = start_agent(f"--tokens_file={table}", token=ops)
    ids, gens = agent.allocate(1, token=acme)
    region = agent.region(token=acme)
    data = os.urandom(agent.bytes_per_block)
    seg = agent.bytes_per_block // agent.layers
    for layer in range(agent.layers):
        start = layer * ENGINE_BLOCKS * seg
        region.buffer[start:start + seg] = data[layer * seg:(layer + 1) * seg]
    assert region.store(ids, [0], owner_epoch=agent.epoch, generations=gens) == 1
    # Revoked: the file rewritten without acme; wait until the agent has reloaded it.
    write([ops_line])
    deadline = time.monotonic() + 10
    while True:
        try:
            agent.allocate(1, token=acme)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            break
        assert time.monotonic() < deadline, "the agent did not reload its tokens file"
        time.sleep(0.05)
    before = bytes(region.buffer)
    with pytest.raises(kvcm.Unauthenticated, match="session is closed"):
        region.load(ids, [1], owner_epoch=agent.epoch)
    assert bytes(region.buffer) == before
    with pytest.raises(kvcm.Unavailable):  # the agent hung up
        region.store(ids, [1], owner_epoch=agent.epoch, generations=gens)
    region.close()
    # A new session with the revoked token is refused at its hello.
    with pytest.raises(kvcm.Unauthenticated):
        agent.region(token=acme)
    agent.proc.wait_for_log("closed: ", 5)


def test_a_sparse_memfd_is_refused_and_no_hole_can_be_punched_later(start_agent) -> None:
    agent = start_agent()
    bpb = agent.bytes_per_block
    # A sparse 1 GiB memfd (the issue's: LOADs into it would allocate shmem charged to the
    # agent): refused, and nothing of it allocated.
    big = (1 << 30) // bpb * bpb
    fd = sealed_memfd(big, allocate=False)
    sock, reply = raw_hello(agent.socket_path, fd, big, bpb)
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], reply
    assert "allocate" in reply.message
    assert os.fstat(fd).st_blocks == 0
    os.close(fd)
    # Allocated: registered, then sealed; punching a hole is EPERM from now on.
    fd = sealed_memfd(2 * bpb, allocate=True)
    sock.close()
    sock, reply = raw_hello(agent.socket_path, fd, 2 * bpb, bpb)
    assert reply.code == 0, reply
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    punch = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    assert libc.fallocate(fd, punch, 0, 4096) == -1
    assert ctypes.get_errno() == errno.EPERM
    assert os.fstat(fd).st_blocks * 512 >= 2 * bpb
    sock.close()
    os.close(fd)


# Opens /proc/<pid>/mem for reading (what reading another process's memory starts with):
# prints "opened", or the shell's error (e.g. "Permission denied").
READ_MEM = 'exec 3< "/proc/$1/mem" && echo opened'


def test_a_process_of_the_agents_uid_cannot_read_its_memory(manager_factory,
                                                              workdir: Path) -> None:
    """The attack: a process of the agent's uid (an engine on the local socket, which the
    socket's mode required) opens /proc/<agent>/mem. Without CAP_SYS_PTRACE it must fail. As
    root (which has it) the agent and the attacker both run as nobody; a control process of
    the same uid shows the attacker could read a dumpable one."""
    agent_bin = binary("KVCM_AGENT_BIN", "kvcm-agent")
    manager = manager_factory().start()
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    user = uid if os.geteuid() == 0 else None
    os.chmod(workdir, 0o777)
    socket_path = str(workdir / "agent.sock")
    log = workdir / "gpu0.log"
    with open(log, "ab") as out:
        agent = subprocess.Popen(
            [agent_bin, "--insecure", "--agent_id=gpu0", f"--manager_address={manager.address}",
             "--model=deepseek-v3", "--capacity_bytes=100000000",
             f"--local_socket={socket_path}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, user=user)
    control = subprocess.Popen(["sleep", "60"], user=user)
    try:
        deadline = time.monotonic() + 15
        while not os.path.exists(socket_path):
            assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)

        def attack(pid: int) -> str:
            r = subprocess.run(["/bin/sh", "-c", READ_MEM, "sh", str(pid)], user=user,
                               capture_output=True, text=True, timeout=30)
            return (r.stdout + r.stderr).strip()

        if attack(control.pid) != "opened":
            pytest.skip("a process of one uid cannot read another's /proc/<pid>/mem here "
                        "(Yama ptrace_scope?): the test would prove nothing")
        assert "Permission denied" in attack(agent.pid)
        # Its /proc entries belong to root now, so its fds (mapped engine memfds) are closed to
        # the uid too.
        assert os.stat(f"/proc/{agent.pid}/fd").st_uid == 0
        if user is not None:
            # Running as nobody, it admits only nobody: this process (root) is refused.
            with pytest.raises(kvcm.Unavailable):
                LocalRegion(socket_path, 4096, segment_offsets=[0], segment_bytes=4096,
                            segment_stride=4096, num_engine_blocks=1)
    finally:
        control.kill()
        control.wait()
        agent.terminate()
        try:
            agent.wait(5)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
