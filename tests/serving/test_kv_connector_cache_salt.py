"""``cache_salt`` (vLLM's request field) from the OpenAI API to the scheduler: tenants with
different salts never share prefix-cache blocks, a tenant shares its own, and a bad salt is
a 400 naming the field. Served with ``--prefix-caching-hash-algo sha256`` and a KV store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")
pytest.importorskip("grpc_tools", reason="the gRPC stubs are generated with grpcio-tools")

from serve_process import start_serve  # noqa: E402

from fastsched.gateway.openai_protocol import ApiError, parse_completion  # noqa: E402

PROMPT = "the quick brown fox jumps over the lazy dog " * 8  # a few blocks of 16 tokens on the tiny model


def test_the_salt_reaches_the_grpc_request() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "cache_salt": "tenant-1"}
    assert [r.cache_salt for r in parse_completion(body, "r").grpc_requests()] == ["tenant-1", "tenant-1"]
    unsalted = parse_completion({"model": "m", "prompt": "a"}, "r").grpc_requests()[0]
    assert not unsalted.HasField("cache_salt")


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", "cache_salt must be a non-empty string"),
        (7, "cache_salt must be a non-empty string"),
        ("x" * 257, "cache_salt has 257 characters, more than 256"),
    ],
)
def test_a_bad_salt_is_a_400_naming_it(salt: object, message: str) -> None:
    with pytest.raises(ApiError) as error:
        parse_completion({"model": "m", "prompt": "a", "cache_salt": salt}, "r")
    assert error.value.status == 400 and error.value.param == "cache_salt" and message in str(error.value)


def cached_tokens(url: str, salt: str | None, endpoint: str = "completions") -> int:
    body: dict = {"model": "model", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    if salt is not None:
        body["cache_salt"] = salt
    reply = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60, trust_env=False)
    assert reply.status_code == 200, reply.text
    return (reply.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_s8_tenants_with_different_salts_share_no_prefix_blocks(tiny_model_dir: Path, tmp_path: Path) -> None:
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "store"), "max_size": "64MiB"},
    }
    server = start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--enable-prompt-tokens-details",
        "--prefix-caching-hash-algo",
        "sha256",
        "--kv-transfer-config",
        json.dumps(kv),
    )
    try:
        assert cached_tokens(server.url, "tenant-a") == 0
        assert cached_tokens(server.url, "tenant-a") > 0
        assert cached_tokens(server.url, "tenant-b") == 0
        assert cached_tokens(server.url, None) == 0
        assert cached_tokens(server.url, "tenant-b", "chat/completions") == 0
        assert cached_tokens(server.url, "tenant-b", "chat/completions") > 0
        bad = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "model", "prompt": "a", "cache_salt": ""},
            timeout=60,
            trust_env=False,
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
        assert server.terminate() == 0, server.tail()
    finally:
        server.close()
