"""The consumer's end of a request in flight, shared by :class:`RequestStream` and
:class:`Session`: whoever holds it owns the request, so closing it, leaving its
``async with`` block early or dropping it aborts the request in the engine, which
frees its runner slot and KV blocks at once."""

from __future__ import annotations

from typing import Any, Generic, Protocol, Self, TypeVar


class _InFlight(Protocol):
    request_id: str
    engine_index: int


S = TypeVar("S", bound=_InFlight)
S_contra = TypeVar("S_contra", bound=_InFlight, contravariant=True)


class RequestOwner(Protocol[S_contra]):
    """Who ends a request early: the frontend's request table."""

    def drop(self, state: S_contra) -> None: ...


class RequestHandle(Generic[S]):
    def __init__(self, owner: RequestOwner[Any], state: S) -> None:
        self._owner = owner
        self._state = state
        self._closed = False  # nothing more will be yielded

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def engine_index(self) -> int:
        return self._state.engine_index

    async def aclose(self) -> None:
        """Stops listening; aborts the request in the engine if it is still running."""
        self._close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner.drop(self._state)

    def __del__(self) -> None:
        # A consumer that stopped iterating without aclose(): still abort.
        if not self._closed:
            try:
                self._close()
            except Exception:
                pass
