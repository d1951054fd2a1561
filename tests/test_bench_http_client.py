"""``fastsched bench serve``'s HTTP client: kept-alive connections are reused, and one the
server closed while idle is replaced without failing the request."""

from __future__ import annotations

import asyncio
import json

from fastsched.tools.bench_serve import HttpClient


class CountingServer:
    """Answers every request with a chunked JSON body; counts connections; closes a
    connection after ``requests_per_connection`` answers (None: never)."""

    def __init__(self, requests_per_connection: int | None = None) -> None:
        self.connections = 0
        self.requests_per_connection = requests_per_connection

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while (line := await reader.readline()) not in (b"", b"\r\n"):
                length = 0
                while (header := await reader.readline()) != b"\r\n":
                    name, _, value = header.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                body = json.dumps({"path": line.split()[1].decode()}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    + b"%x\r\n" % len(body)
                    + body
                    + b"\r\n0\r\n\r\n"
                )
                await writer.drain()
                served += 1
                if served == self.requests_per_connection:
                    break
        finally:
            writer.close()


async def _run(server: CountingServer, paths: list[str], pause_s: float = 0.0) -> list[tuple[int, object]]:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client = HttpClient(f"http://127.0.0.1:{port}")
    answers = []
    try:
        for path in paths:
            answers.append(await client.get_json(path))
            await asyncio.sleep(pause_s)
    finally:
        client.close()
        listener.close()
        await listener.wait_closed()
    return answers


def test_sequential_requests_share_one_kept_alive_connection() -> None:
    server = CountingServer()
    answers = asyncio.run(_run(server, [f"/r{i}" for i in range(5)]))
    assert answers == [(200, {"path": f"/r{i}"}) for i in range(5)]
    assert server.connections == 1


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    server = CountingServer(requests_per_connection=1)
    answers = asyncio.run(_run(server, ["/a", "/b", "/c"], pause_s=0.05))
    assert answers == [(200, {"path": p}) for p in ("/a", "/b", "/c")]
    assert server.connections == 3
