#!/usr/bin/env python3
"""Prints N (default 1) distinct TCP ports nothing is bound to on any address, from 20000-31999.

Below Linux's ephemeral range (32768-60999), where the kernel also picks the local ports of
outgoing connections: a port bound to 0 and closed could be taken by any client's connect()
before the test's server binds it. The shell tests' twin of tests/util/child_process.h's FreePort.
"""
import random
import socket
import sys

count = int(sys.argv[1]) if len(sys.argv) > 1 else 1
ports = []
while len(ports) < count:
    port = random.randrange(20000, 32000)
    if port in ports:
        continue
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))  # no SO_REUSEADDR: TIME_WAIT counts as taken
        except OSError:
            continue
    ports.append(port)
print(" ".join(map(str, ports)))
