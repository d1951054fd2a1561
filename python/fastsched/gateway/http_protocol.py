"""The gateway's HTTP/1.1 protocol: uvicorn's h11 protocol with header limits.

uvicorn bounds neither how long a client may take to send a request's headers nor (in
a way a client can read) how large they may be: a connection that sends half a request
line stays open for good, and headers past h11's buffer get a 400 followed by a close
that, with the rest of the headers still unread, resets the connection before the
client reads the answer. Here:

- ``header_timeout``: a connection must send a complete request line and headers within
  this many seconds of connecting (or of its previous response, when kept alive);
  otherwise it gets 408 (or is closed, if it sent nothing) — so idle or half-open
  connections cannot pile up.
- ``max_header_bytes``: larger request headers get 431 (RFC 6585), and the connection is
  closed only after the client's remaining bytes have been read and dropped for a moment
  (a lingering close, as nginx does), so that the client does read the 431.

The body's own timeout is the app's (``Gateway._read_body``).
"""

from __future__ import annotations

import asyncio
import http
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fastsched.limits import RequestLimits

_LINGER_S = 2.0  # how long unread request bytes are drained before closing after an error


class _Connection(h11.Connection):
    """Remembers the status h11 suggests for the last malformed request (431 when the
    headers outgrew the buffer), which uvicorn drops."""

    error_status = 400

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            raise


class GuardedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` plus the header timeout and the 431 (module docstring)."""

    limits = RequestLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, self.limits.max_header_bytes)
        self._header_timer: asyncio.TimerHandle | None = None
        self._received = False  # any byte of the current request yet
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
        self._received = True
        if self.conn.their_state is h11.IDLE:  # the request line and headers are arriving
            if self._header_timer is None:
                self._arm_header_timer()  # a kept-alive connection starts its next request
            if self._headers_too_large(data):
                self.conn.error_status = http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
                self.send_400_response("")
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._disarm_header_timer()

    def _headers_too_large(self, data: bytes) -> bool:
        """Whether the request line and headers, with ``data``, outgrow ``max_header_bytes``.
        h11's own bound only applies while they are incomplete: headers that arrive whole in
        one read would pass it at any size."""
        pending = self.conn.trailing_data[0] + data
        end = pending.find(b"\r\n\r\n")
        size = len(pending) if end < 0 else end + 4
        return size > self.limits.max_header_bytes

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._received = False

    def send_400_response(self, msg: str) -> None:
        status = self.conn.error_status
        if status == http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
            msg = (f"The request line and headers exceed this server's limit of {self.limits.max_header_bytes} "
                   "bytes (--max-header-bytes).")
        self._send_error_and_linger(status, msg)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self._received:  # nothing sent: just close, as for an idle kept-alive connection
            self.transport.close()
            return
        self._send_error_and_linger(http.HTTPStatus.REQUEST_TIMEOUT,
                                    f"The request line and headers were not received within "
                                    f"{self.limits.header_timeout:g} s (--header-timeout).")

    def _send_error_and_linger(self, status: int, msg: str) -> None:
        """Answers ``status`` with ``msg`` (plain text) outside h11 (whose state may be an
        error already), half-closes, and drops what the client still sends for a moment."""
        self._disarm_header_timer()
        if self.transport.is_closing():
            return
        body = msg.encode()
        phrase = http.HTTPStatus(status).phrase
        head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)


def guarded_h11_protocol(limits: RequestLimits) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's ``http=`` setting, with ``limits``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
