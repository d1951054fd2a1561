"""``fastsched bench serve`` against a server whose stream has no usage chunk (llama-cpp-python's
OpenAI server): the output length is the number of chunks that carry text, and the request
asks for its full length with ``min_tokens`` as well as ``ignore_eos``."""

from __future__ import annotations

import asyncio
import json

from fastsched.tools.bench_serve import CHAT_COMPLETIONS, HttpClient, send_request
from fastsched.tools.workload import BenchRequest


class UsagelessServer:
    """Streams a role-only chunk, then one chunk per word of ``words``, then ``[DONE]``; keeps
    the last request body."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.body: dict | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        length = 0
        while (header := await reader.readline()) != b"\r\n":
            name, _, value = header.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        self.body = json.loads(await reader.readexactly(length))
        deltas = [{"role": "assistant"}, *({"content": w} for w in self.words)]
        events = b"".join(
            b"data: " + json.dumps({"choices": [{"delta": d}]}).encode() + b"\n\n" for d in deltas
        )
        events += b"data: [DONE]\n\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(events) + events
        )
        await writer.drain()
        writer.close()


async def _send(server: UsagelessServer) -> object:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}")
    try:
        return await send_request(client, "m", BenchRequest([1, 2, 3], 3, text="hi"), CHAT_COMPLETIONS)
    finally:
        client.close()
        listener.close()
        await listener.wait_closed()


def test_a_stream_without_usage_counts_one_token_a_text_chunk() -> None:
    server = UsagelessServer(["a", " b", " c"])
    result = asyncio.run(_send(server))
    assert result.error is None and result.output_tokens == 3 and len(result.itl) == 2
    assert server.body["min_tokens"] == server.body["max_tokens"] == 3 and server.body["ignore_eos"] is True


def test_a_stream_without_any_token_is_an_error() -> None:
    result = asyncio.run(_send(UsagelessServer([])))
    assert result.error == "the stream ended without a token"
