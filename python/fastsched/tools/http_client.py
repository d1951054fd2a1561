"""The load generator's HTTP/1.1 transport (``fastsched bench serve``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HttpClient:
    """A lean HTTP/1.1 client on asyncio streams: kept-alive connections reused between
    requests (as the connection pools of real clients and of vLLM's benchmark are),
    chunked or sized bodies. httpx spends ~10 ms of CPU per streamed request, so at a few
    hundred requests/s a load generator built on it measures its own queue, not the
    server's; this one spends well under 1 ms."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be http(s)://host[:port], got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.base_path = parts.path.rstrip("/")
        self.head = f"Host: {parts.netloc}\r\nAccept: */*\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in (headers or {}).items()
        )
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open(self, method: str, path: str, payload: Any = None) -> tuple[int, dict[str, str], Any, Any]:
        """Sends the request; returns (status, headers, reader, writer) once the headers are in.
        Give the connection back with ``release`` when the body has been read."""
        body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        head = f"{method} {self.base_path}{path} HTTP/1.1\r\n{self.head}"
        if payload is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        request = head.encode("latin-1") + b"\r\n" + body
        while True:
            reused = bool(self._idle)
            reader, writer = (
                self._idle.pop()
                if reused
                else await asyncio.open_connection(self.host, self.port, ssl=self.ssl or None)
            )
            try:
                writer.write(request)
                status_line = await reader.readline()
            except (ConnectionError, OSError):
                writer.close()
                if reused:  # the server closed it while it was idle: try another
                    continue
                raise
            if not status_line and reused:
                writer.close()
                continue
            try:
                return (*await self._read_head(status_line, reader), reader, writer)  # type: ignore[return-value]
            except BaseException:
                writer.close()
                raise

    @staticmethod
    async def _read_head(status_line: bytes, reader: Any) -> tuple[int, dict[str, str]]:
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}")
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    def release(self, headers: dict[str, str], reader: Any, writer: Any, complete: bool) -> None:
        """Keeps the connection for the next request if its response was read to the end
        (``complete``) and the server keeps it open; else closes it."""
        if complete and headers.get("connection", "").lower() != "close" and not reader.at_eof():
            self._idle.append((reader, writer))
        else:
            writer.close()

    def close(self) -> None:
        """Closes the idle connections."""
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    @staticmethod
    async def chunks(reader: Any, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body as it arrives, read to its end."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers, then the blank line that ends the body
                    return
                data = await reader.readexactly(size + 2)  # the chunk and its CRLF
                yield data[:-2]
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            while data := await reader.read(65536):
                yield data

    async def get(self, path: str) -> tuple[int, bytes]:
        """(status, body) of ``GET path``."""
        return await self._whole("GET", path)

    async def post_json(self, path: str, payload: Any) -> tuple[int, bytes]:
        """(status, body) of ``POST path`` with ``payload`` as JSON."""
        return await self._whole("POST", path, payload)

    async def _whole(self, method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
        status, headers, reader, writer = await self.open(method, path, payload)
        complete = False
        try:
            body = b"".join([chunk async for chunk in self.chunks(reader, headers)])
            complete = True
        finally:
            self.release(headers, reader, writer, complete)
        return status, body

    async def get_json(self, path: str) -> tuple[int, Any]:
        status, body = await self.get(path)
        return status, json.loads(body) if body else None
