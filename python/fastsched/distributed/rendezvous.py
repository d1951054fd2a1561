"""Where the ranks of a tensor-parallel group meet, and on which address each listens.

``init_process_group(init_method="tcp://127.0.0.1:P")`` makes rank 0's ``TCPStore``
listen on every interface (``[::]:P``, IPv4 and IPv6) whatever host the URL names, and
gloo's and NCCL's own connections listen on the address the machine's host name resolves
to. So rank 0 binds the store's socket itself, on the group's host only (loopback for local
workers, the node's own address with Ray), and hands it to the store
(``master_listen_fd``); each rank pins its collectives' sockets to the interface that holds
that host (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the operator set them).

The store speaks no authentication: anyone who reaches the port may connect. Every key of
the group lives under a random secret prefix that only the ranks know (it travels in their
``WorkerSpec``, never on a command line), so a stranger can neither read the group's keys
nor set one the ranks would take.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import secrets
import socket
import struct
from dataclasses import dataclass

import torch.distributed as dist

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# The ones the operator set before fastsched ran: those are theirs, never overridden.
_OPERATOR_IFNAMES = frozenset(v for v in _IFNAME_VARIABLES if v in os.environ)


@dataclass(frozen=True)
class Rendezvous:
    """The address of rank 0's store and the group's secret key prefix."""

    host: str
    port: int
    secret: str

    def connect(self, size: int, timeout: datetime.timedelta, own_host: str) -> dist.Store:
        """A rank other than 0: its view of rank 0's store, under the group's prefix; its own
        collectives listen on ``own_host`` (an address of its node)."""
        pin_interfaces(own_host)
        store = dist.TCPStore(self.host, self.port, size, is_master=False, timeout=timeout)
        return dist.PrefixStore(self.secret, store)


def listen(host: str, size: int, timeout: datetime.timedelta) -> tuple[Rendezvous, dist.Store]:
    """Rank 0: its store, listening on ``host`` only, and the rendezvous the others connect to."""
    pin_interfaces(host)
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        sock.listen(size)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            host,
            port,
            size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
        sock.detach()  # the store owns the socket now
    rendezvous = Rendezvous(host, port, secrets.token_hex(16))
    return rendezvous, dist.PrefixStore(rendezvous.secret, store)


def pin_interfaces(host: str) -> None:
    """gloo and NCCL listen on the interface that holds ``host`` (not the host name's address)."""
    name = interface_of(host)
    for variable in _IFNAME_VARIABLES:
        if variable not in _OPERATOR_IFNAMES:
            os.environ[variable] = name


def interface_of(host: str) -> str:
    """The name of this machine's network interface that holds address ``host``; ``ValueError``
    when none does (the group's host must be one of this node's own addresses)."""
    address = ipaddress.ip_address(host)
    for _, name in socket.if_nameindex():
        if address in _addresses(name, address.version):
            return name
    raise ValueError(f"no network interface of this machine has the address {host}")


def _addresses(name: str, version: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    if version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                rows = [line.split() for line in f]
        except OSError:
            return set()
        return {ipaddress.ip_address(bytes.fromhex(row[0])) for row in rows if row[-1] == name}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # the interface has no IPv4 address
            return set()
    return {ipaddress.ip_address(raw[20:24])}
