"""conftest.free_ports: parallel test processes must not be handed the same ports."""

from __future__ import annotations

import random
import socket

from conftest import free_ports


def test_a_reseeded_global_random_does_not_repeat_the_ports_picked():
    """An in-process trainer reseeds ``random`` with the same seed in every test process (HF
    ``Trainer``'s set_seed(42)); the picks after each reseed must still differ, or two processes
    probe, find free and hand out the same port."""
    picks = set()
    for _ in range(5):
        random.seed(42)
        picks.add(free_ports(1))
    assert len(picks) > 1, picks


def test_the_ports_picked_are_free_and_consecutive_below_the_ephemeral_range():
    base = free_ports(3)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        ephemeral = int(fh.read().split()[0])
    assert 10000 <= base and base + 3 <= ephemeral
    sockets = [socket.socket() for _ in range(3)]
    try:
        for offset, sock in enumerate(sockets):
            sock.bind(("127.0.0.1", base + offset))
    finally:
        for sock in sockets:
            sock.close()
