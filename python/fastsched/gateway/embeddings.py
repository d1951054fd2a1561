"""OpenAI's embeddings API: ``POST /v1/embeddings``.

Each input (a string, or a list of token ids; ``input`` may be one or a list of them, up to
``--max-prompts-per-request``) is one ``Generate`` call with ``embed`` set, through the same
gate and admission as every request: the engine computes its prompt (a prefill, counted by
the token valves like any other) and answers the hidden state of its last token, L2-normalised
— vLLM's pooling for a generative model served as an embedding model (``LAST``, normalised).
No token is generated (a prefill-only request, S20); the request's KV blocks are freed when it ends (the
prefix cache may keep them, as any prompt's).

``encoding_format`` ``float`` (the default) or ``base64`` (little-endian float32, as OpenAI's
clients decode it); ``dimensions`` must be the model's hidden size, which is all a model not
trained for shortened embeddings can honour (a 400 otherwise, as vLLM answers for a model
without Matryoshka support). The size is learnt from the first embedding computed, so the
first request with another ``dimensions`` is answered 400 once its embedding is in.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastsched.gateway.errors import api_error_from_rpc
from fastsched.gateway.openai_protocol import INT32, ParsedRequest, bad_request, check_fields
from fastsched.gateway.request_fields import shorten
from fastsched.gateway.request_ids import assign_request_id
from fastsched.gateway.state import GatewayState
from fastsched.gateway.streams import ClientWatch, merge_streams
from fastsched.limits import check_cache_salt, check_prompt_chars
from fastsched.proto_gen import import_stubs

pb, _ = import_stubs()

FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "priority", "cache_salt"})
_FORMATS = ("float", "base64")


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) and INT32[0] <= v <= INT32[1] for v in value)
    )


def _inputs(value: Any) -> list[str | list[int]]:
    if isinstance(value, str) or _is_token_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or _is_token_ids(v) for v in value):
        return list(value)
    raise bad_request(
        "input must be a string, a list of strings, a list of token ids or a list of lists of "
        f"token ids, got {shorten(value)}",
        "input",
    )


def parse_embeddings(
    body: dict[str, Any], request_id: str, gateway: GatewayState, max_model_len: int | None
) -> tuple[ParsedRequest, str, int | None]:
    """The request's Generate calls, its ``encoding_format`` and ``dimensions``."""
    check_fields(body, FIELDS)
    inputs = _inputs(body.get("input"))
    gateway.limits.check_num_prompts(len(inputs))
    if any(isinstance(p, str) and not p for p in inputs):
        raise bad_request("input strings must not be empty", "input")
    max_token_chars = getattr(gateway.tokenizer, "max_token_chars", None)
    if max_model_len is not None and max_token_chars is not None:
        for p in inputs:
            if isinstance(p, str):
                check_prompt_chars(len(p), max_model_len, max_token_chars, "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in _FORMATS:
        raise bad_request(
            f"encoding_format must be one of {list(_FORMATS)}, got {shorten(encoding)}", "encoding_format"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
        raise bad_request(f"dimensions must be an integer, got {shorten(dimensions)}", "dimensions")
    known = gateway.embedding_size
    if dimensions is not None and known is not None and dimensions != known:
        raise _dimensions_error(dimensions, known)
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not INT32[0] <= priority <= INT32[1]:
        raise bad_request(f"priority must be an integer, got {shorten(priority)}", "priority")
    # A prefill-only request (S20, max_tokens 0): it ends when its prompt is computed.
    sampling = pb.SamplingParams(max_tokens=0)
    parsed = ParsedRequest(
        "completion",
        inputs,
        sampling,
        priority,
        stream=False,
        include_usage=False,
        request_id=request_id,
        cache_salt=check_cache_salt(body.get("cache_salt")),
        embed=True,
    )
    return parsed, encoding, dimensions


def _dimensions_error(dimensions: int, size: int) -> Exception:
    return bad_request(
        f"dimensions {dimensions} cannot be honoured: this model's embeddings have {size} "
        "dimensions and it was not trained for shortened (Matryoshka) ones",
        "dimensions",
    )


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def create_embeddings(gateway: GatewayState, request: Request) -> Response:
    request_id = assign_request_id(request, "embd")
    body, _ = await gateway.read_json(request)
    info = await gateway.pool.model_info()
    max_model_len = info["max_model_len"] if info else None
    parsed, encoding, dimensions = parse_embeddings(body, request_id, gateway, max_model_len)
    parsed = gateway.with_adapter(parsed, body)
    vectors: dict[int, list[float]] = {}
    prompt_tokens = 0
    async with ClientWatch(request.receive) as watch:
        streams = await gateway.open_all(parsed)
        try:
            async for index, resp in merge_streams(streams):
                if resp.HasField("usage"):
                    prompt_tokens += resp.usage.prompt_tokens
                    vectors[index] = list(resp.embedding)
        except grpc.aio.AioRpcError as e:
            raise api_error_from_rpc(e, gateway.retry_after_s) from e
        finally:
            for stream in streams:
                stream.cancel()
    if watch.gone:
        return Response(status_code=499)
    gateway.embedding_size = size = len(vectors[0])
    if dimensions is not None and dimensions != size:
        raise _dimensions_error(dimensions, size)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(vectors[i], encoding)}
        for i in range(len(parsed.prompts))
    ]
    return JSONResponse(
        {
            "id": request_id,
            "object": "list",
            "created": parsed.created,
            "model": parsed.lora_name or gateway.model_name,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )
