"""tessel.spawn: the port a rendezvous will bind."""

import socket
from pathlib import Path

from tessel.spawn import free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    """gloo's connections take ports from the kernel's ephemeral range; a rendezvous port chosen from it
    was once taken between the check and the bind (EADDRINUSE in a full suite)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(8)}
    assert all(1024 <= port < low for port in ports)
    assert len(ports) > 1  # drawn at random: two concurrent spawns rarely try the same one
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
