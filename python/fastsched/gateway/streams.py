"""What every generating route of the gateway shares: the streams of a request's prompts merged
as they arrive, and the watch that ends a request's work when its client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from starlette.types import Receive

from fastsched.gateway.pool import FrontendStream


async def merge_streams(streams: Sequence[FrontendStream]) -> AsyncIterator[tuple[int, Any]]:
    """``(prompt_index, response)`` from all streams as they arrive."""
    if len(streams) == 1:
        async for resp in streams[0]:
            yield 0, resp
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: FrontendStream) -> None:
        try:
            async for resp in stream:
                await queue.put((i, resp))
        except grpc.aio.AioRpcError as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class ClientWatch:
    """``async with ClientWatch(receive) as watch``: if the client disconnects inside the
    block, the task serving it is cancelled (its gRPC calls with it, so the frontends abort
    the request in the engine), the block ends quietly and ``watch.gone`` is True. One
    watcher task per request, however long it streams."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = False

    async def __aenter__(self) -> ClientWatch:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self._task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> bool:
        self._watcher.cancel()
        if self.gone and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            self._task.uncancel()
            return True
        return False
