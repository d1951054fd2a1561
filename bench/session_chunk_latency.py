"""What a streaming-input session (S15) saves: the latency of one more chunk on top of a long
history held in the session, against the same history sent again as a fresh request (with
and without a prefix-cache hit). Against a running ``fastsched serve``:

    python bench/session_chunk_latency.py --url http://127.0.0.1:8000 --api-key KEY

Each measure is the time from sending the input to its first generated token (``max_tokens``
1), the median of ``--repeats`` runs. Prompts are random token ids, different per run, so
that only the case meant to hit the prefix cache does.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx
from websockets.sync.client import connect


def session_chunk_s(ws_url: str, headers: dict[str, str], history: list[int], chunk: list[int]) -> float:
    with connect(ws_url, additional_headers=headers) as ws:
        ws.send(json.dumps({"type": "open", "prompt": history, "max_tokens": 1, "temperature": 0}))
        while not json.loads(ws.recv())["segment_ended"]:
            pass
        start = time.perf_counter()
        ws.send(json.dumps({"type": "chunk", "prompt": chunk, "max_tokens": 1, "last": True}))
        json.loads(ws.recv())
        return time.perf_counter() - start


def fresh_request_s(http: httpx.Client, headers: dict[str, str], prompt: list[int]) -> float:
    start = time.perf_counter()
    r = http.post(
        "/v1/completions", headers=headers, json={"prompt": prompt, "max_tokens": 1, "temperature": 0}
    )
    r.raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--history", type=int, default=1024, help="tokens held by the session before the chunk"
    )
    parser.add_argument("--chunk", type=int, default=16, help="tokens of the chunk measured")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, args.vocab) for _ in range(n)]

    ws_url = args.url.replace("http://", "ws://") + "/v1/sessions"
    session, cold, warm = [], [], []
    with httpx.Client(base_url=args.url, timeout=600) as http:
        for _ in range(args.repeats):
            history, chunk = tokens(args.history), tokens(args.chunk)
            session.append(session_chunk_s(ws_url, headers, history, chunk))
            cold.append(fresh_request_s(http, headers, tokens(args.history + args.chunk)))
            fresh_request_s(http, headers, history)  # its full blocks are now cached
            warm.append(fresh_request_s(http, headers, history + chunk))
    for name, values in (
        ("session chunk", session),
        ("fresh request, prefix cached", warm),
        ("fresh request, nothing cached", cold),
    ):
        print(
            f"{name:32s} median {statistics.median(values) * 1000:8.1f} ms  "
            f"(history {args.history} + chunk {args.chunk} tokens, {args.repeats} runs)"
        )


if __name__ == "__main__":
    main()
