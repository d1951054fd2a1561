"""The tensor-parallel rendezvous (``fastsched.distributed.rendezvous``): rank 0's store
listens on the group's host only, and its keys live under a secret only the ranks know."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from fastsched.distributed.rendezvous import interface_of, listen

TIMEOUT = datetime.timedelta(seconds=20)


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net shows them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                local, state = row.split()[1], row.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


def test_rank_0s_store_listens_on_the_groups_host_only() -> None:
    rendezvous, _store = listen("127.0.0.1", 2, TIMEOUT)
    assert listening_addresses(rendezvous.port) == ["0100007F"]  # 127.0.0.1, no [::]


def test_a_rank_with_the_secret_sees_the_groups_keys_and_a_stranger_does_not() -> None:
    rendezvous, store = listen("127.0.0.1", 3, TIMEOUT)
    store.set("rank0", b"hello")
    assert rendezvous.connect(3, TIMEOUT, "127.0.0.1").get("rank0") == b"hello"
    stranger = dist.TCPStore("127.0.0.1", rendezvous.port, 3, is_master=False, timeout=TIMEOUT)
    assert not stranger.check(["rank0"])
    stranger.set("rank0", b"forged")
    assert store.get("rank0") == b"hello"
    assert len(rendezvous.secret) >= 32


def test_the_collectives_interface_is_the_one_holding_the_host() -> None:
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(ValueError, match="no network interface of this machine has the address 198.51.100.7"):
        interface_of("198.51.100.7")


def test_the_collectives_are_pinned_to_the_hosts_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastsched.distributed import rendezvous

    monkeypatch.setattr(rendezvous, "_OPERATOR_IFNAMES", frozenset({"NCCL_SOCKET_IFNAME"}))
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")  # the operator's: kept
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # a previous group's: replaced
    rendezvous.pin_interfaces("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "eth7"
