"""docs/deploy.md: every port of ``fastsched serve`` listens on the configured host, loopback
by default: the gateway, the gRPC frontends, the engines, and the tensor-parallel ranks'
rendezvous store and collectives, whose ``TCPStore`` once listened on ``[::]`` (every
interface, IPv4 and IPv6) although its URL named 127.0.0.1. Read from each process's
sockets (psutil), for two data-parallel engines of two tensor-parallel ranks each.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from serve_process import start_serve  # noqa: E402


def listening(pid: int) -> dict[int, list[tuple[str, int]]]:
    """pid -> the (address, port) each TCP socket of the process and of its descendants listens on."""
    root = psutil.Process(pid)
    found: dict[int, list[tuple[str, int]]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found[proc.pid] = [(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # gRPC's ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def test_every_process_of_serve_with_tp2_and_dp2_listens_on_loopback_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "2",
    )
    try:
        sockets = listening(server.proc.pid)
        processes = [pid for pid, found in sockets.items() if found]
        # the gateway, 2 frontends, 2 engines (rank 0: the store and gloo) and their 2 workers (gloo)
        assert len(sockets) >= 1 + 2 + 2 + 2, sockets
        assert len(processes) >= 1 + 2 + 2 + 2, sockets
        wildcard = {pid: [a for a in found if not _loopback(a[0])] for pid, found in sockets.items()}
        assert not any(wildcard.values()), f"listening beyond loopback: {wildcard}"
    finally:
        server.close()
