"""A real kvcm-manager process on a loopback port, for integration tests.

    m = ManagerProcess(os.environ["KVCM_MANAGER_BIN"], tmp_path, tokens={...})
    address = m.start()
    ...
    m.restart()     # same port, same secret: sessions and engine pools are gone
    m.stop()
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc


# Ports handed out below Linux's ephemeral range (32768-60999 by default), where the kernel
# also picks the local ports of outgoing connections: a port bound to 0 and closed could be
# taken by any client's connect() before the server binds it (seen with a flood test running
# beside these). Each process walks the range from a random start.
_PORT_RANGE = (20000, 32000)
_next_port = random.randrange(*_PORT_RANGE)


def free_port() -> int:
    """A TCP port nothing was bound to on any address a moment ago, below the ephemeral range;
    never the same twice in one process (until the range wraps)."""
    global _next_port
    low, high = _PORT_RANGE
    for _ in range(high - low):
        port = _next_port
        _next_port = low + (_next_port + 1 - low) % (high - low)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # no SO_REUSEADDR: TIME_WAIT counts as taken
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in %d-%d" % _PORT_RANGE)


class ManagerProcess:
    """`tokens`: bearer token -> the rest of its tokens-file line (name and grants, e.g.
    "vllm-0 roles=engine engine=vllm-0 tenant=acme"); None runs without a tokens file."""

    def __init__(self, binary: str, workdir: str | os.PathLike, *, secret: bytes = bytes(16),
                 tokens: dict[str, str] | None = None, flags: tuple[str, ...] = (),
                 tls: tuple[str, str, str] | None = None):
        self.binary = binary
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.secret = secret
        self.tokens = tokens
        self.flags = flags
        # (certificate, key, CA) PEM files: serve mutual TLS instead of plaintext.
        self.tls = tls
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "manager.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        secret = self.dir / "hash_secret"
        secret.write_text(self.secret.hex())
        args = [self.binary, f"--listen_address={self.address}", "--metrics_address=",
                f"--hash_secret_file={secret}"]
        if self.tls is None:
            args.append("--insecure")
        else:
            cert, key, ca = self.tls
            args += [f"--tls_cert_file={cert}", f"--tls_key_file={key}", f"--tls_ca_file={ca}"]
        if self.tokens is not None:
            lines = [f"{hashlib.sha256(t.encode()).hexdigest()} {rest}"
                     for t, rest in self.tokens.items()]
            path = self.dir / "tokens"
            path.write_text("\n".join(lines) + "\n")
            args.append(f"--tokens_file={path}")
        return args + list(self.flags)

    def start(self, timeout_s: float = 15.0) -> str:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        with self.channel() as ch:
            ready = grpc.channel_ready_future(ch)
            try:
                while True:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"kvcm-manager exited with {self.proc.returncode}:\n"
                                           + self.log_path.read_text()[-3000:])
                    try:
                        ready.result(timeout=0.2)
                        return self.address
                    except grpc.FutureTimeoutError:
                        if time.monotonic() > deadline:
                            raise RuntimeError("kvcm-manager did not start listening") from None
            finally:
                ready.cancel()

    def credentials(self, client_cert: tuple[str, str] | None = None) -> grpc.ChannelCredentials:
        """TLS credentials trusting the manager's CA (with a client certificate, or none)."""
        assert self.tls is not None
        cert = key = None
        if client_cert is not None:
            cert, key = (Path(p).read_bytes() for p in client_cert)
        return grpc.ssl_channel_credentials(Path(self.tls[2]).read_bytes(), key, cert)

    def channel(self) -> grpc.Channel:
        """A blocking channel to the manager (its own certificate as the client's, on TLS)."""
        if self.tls is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, self.credentials(self.tls[:2]))

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> str:
        self.kill()
        return self.start()
