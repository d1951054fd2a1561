"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol with header limits.

httptools (llhttp, in C) parses a request several times faster than h11 in Python; on
the serving path it took ~16 % off the gateway's CPU per request (bench/RESULTS.md).
uvicorn bounds neither how long a client may take to send a request's headers nor how
large they may be: a connection that sends half a request line stays open for good, and
llhttp accepts headers of any size. Here:

- ``header_timeout``: a connection must send a complete request line and headers within
  this many seconds of connecting (or of its first byte of a later request, when kept
  alive); otherwise it gets 408 (or is closed, if it sent nothing), so idle or half-open
  connections cannot pile up.
- ``max_header_bytes``: larger request lines and headers get 431 (RFC 6585), and the
  connection is closed only after the client's remaining bytes have been read and dropped
  for a moment (a lingering close, as nginx does), so that the client does read the 431.
  Malformed requests get their 400 the same way (uvicorn closes at once, which resets a
  connection whose bytes are unread before the client reads the answer).

The body's own timeout is the app's (``Gateway._read_body``).
"""

from __future__ import annotations

import asyncio
import http
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fastsched.limits import RequestLimits

_LINGER_S = 2.0  # how long unread request bytes are drained before closing after an error
_HEAD_END = b"\r\n\r\n"


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` plus the header timeout and the 431 (module docstring)."""

    limits = RequestLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # the current request's line and headers are not all in yet
        self._head = b""  # their bytes so far (at most max_header_bytes)
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # dropped: the answer is out, the connection is closing
        if self._in_head:
            if self._header_timer is None:
                self._arm_header_timer()  # a kept-alive connection starts its next request
            if self._head_too_large(data):
                self._send_error_and_linger(
                    http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                    f"The request line and headers exceed this server's limit of "
                    f"{self.limits.max_header_bytes} bytes (--max-header-bytes).",
                )
                return
        super().data_received(data)

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the request line and headers, with ``data``, outgrow ``max_header_bytes``;
        keeps their bytes so far while they are incomplete."""
        pending = self._head + data
        end = pending.find(_HEAD_END)
        size = len(pending) if end < 0 else end + len(_HEAD_END)
        if size > self.limits.max_header_bytes:
            return True
        self._head = pending if end < 0 else b""
        return False

    def on_headers_complete(self) -> None:
        self._in_head, self._head = False, b""
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._in_head = True  # the connection's next bytes are the next request's head
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        self._send_error_and_linger(http.HTTPStatus.BAD_REQUEST, msg)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if not self._head:  # nothing sent: just close, as for an idle kept-alive connection
            self.transport.close()
            return
        self._send_error_and_linger(
            http.HTTPStatus.REQUEST_TIMEOUT,
            f"The request line and headers were not received within "
            f"{self.limits.header_timeout:g} s (--header-timeout).",
        )

    def _send_error_and_linger(self, status: int, msg: str) -> None:
        """Answers ``status`` with ``msg`` (plain text), half-closes, and drops what the
        client still sends for a moment."""
        self._disarm_header_timer()
        if self.transport.is_closing():
            return
        body = msg.encode()
        phrase = http.HTTPStatus(status).phrase
        head = (
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)


def guarded_http_protocol(limits: RequestLimits) -> type[GuardedHttpProtocol]:
    """The protocol class for uvicorn's ``http=`` setting, with ``limits``."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})
