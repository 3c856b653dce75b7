"""The lanes' worker plumbing (``tests/helpers.py``): rendezvous ports and the wait on worker processes.
A TP-2 lane whose ranks meet the wrong peer, or whose failed rank leaves the other waiting on gloo's
30-minute timeout, must fail at once with the failing rank's log, not hang the suite."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import free_ports, wait_workers


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = max(int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]), 12000)
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(10000 <= p < low for p in ports), ports
    held = []
    try:
        for p in ports:  # each can be bound at once, as a TCPStore would (no SO_REUSEADDR)
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", p))
    finally:
        for s in held:
            s.close()


def _worker(tmp_path: Path, name: str, code: str) -> tuple[str, Path, subprocess.Popen]:
    log = tmp_path / f"{name}.log"
    with open(log, "w") as f:
        return name, log, subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT)


def test_a_failed_worker_ends_the_wait_and_its_peer_is_killed(tmp_path):
    t0 = time.monotonic()
    workers = [_worker(tmp_path, "rank 1", "import time; time.sleep(120)"),
               _worker(tmp_path, "rank 0", "import sys; print('gloo: connection refused'); sys.exit(3)")]
    failures = wait_workers(workers, 60)
    assert time.monotonic() - t0 < 20
    assert [f.splitlines()[0] for f in failures] == ["rank 1: killed after another worker failed", "rank 0: exit 3"]
    assert "gloo: connection refused" in failures[1]
    assert all(p.poll() is not None for *_, p in workers)


def test_a_hung_worker_is_killed_at_the_deadline_and_named(tmp_path):
    workers = [_worker(tmp_path, "ok", "print('done')"),
               _worker(tmp_path, "hung", "print('waiting on a barrier', flush=True); import time; time.sleep(120)")]
    t0 = time.monotonic()
    failures = wait_workers(workers, 3)
    assert 3 <= time.monotonic() - t0 < 15
    assert failures == ["hung: no exit in 3 s\nwaiting on a barrier\n"]
    assert wait_workers([_worker(tmp_path, "fine", "pass")], 30) == []
