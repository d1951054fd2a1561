"""LoRA over the serving path (gateway -> two gRPC frontends -> an engine process): the
OpenAI ``model`` field selects an adapter, ``/v1/models`` lists adapters with their
``parent``, and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` take vLLM's
bodies, behind the API key, reaching every frontend; an adapter in use is not unloaded."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")

from engine_stack import ipc_dir, launch, teardown  # noqa: E402
from loop_thread import LoopThread, free_port, wait_for  # noqa: E402

from fastsched import LLM, SamplingParams  # noqa: E402
from fastsched.admin import AdminSettings  # noqa: E402
from fastsched.frontend.async_llm import AsyncLLM  # noqa: E402
from fastsched.frontend.grpc_server import serve_frontend  # noqa: E402
from fastsched.frontend.settings import FrontendSettings  # noqa: E402
from fastsched.gateway.app import create_app  # noqa: E402
from fastsched.lora import LoRARequest  # noqa: E402
from fastsched.model_loader import load_tokenizer  # noqa: E402
from fastsched.tools.metrics_snapshot import parse_metrics  # noqa: E402
from fastsched.tools.tiny_lora import make_tiny_lora  # noqa: E402

MODEL = "tiny"
API_KEY = "secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_KEY = "admin-secret"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}  # loads and unloads are admin operations
PROMPT = "def main():\n    return"


@dataclass
class Stack:
    loop: LoopThread
    llms: list[AsyncLLM]
    url: str
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path) -> dict[str, Path]:
    root = tiny_model_dir.parent
    return {
        "one": make_tiny_lora(tiny_model_dir, root / "lora-one", rank=8, seed=1),
        "two": make_tiny_lora(tiny_model_dir, root / "lora-two", rank=4, seed=2),
    }


@pytest.fixture(scope="module")
def stack(
    engine_config: dict,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    adapter_dirs: dict[str, Path],
) -> Iterator[Stack]:
    config = {
        **engine_config,
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
        "lora_modules": [f"one={adapter_dirs['one']}"],
    }
    engines = launch(config, ipc_dir(tmp_path_factory, "ipc"), num_engines=1, num_frontends=2)
    loop = LoopThread()
    llms = [
        loop.call(
            AsyncLLM.start(
                engines.input_addrs,
                engines.output_addrs[i],
                frontend_index=i,
                settings=FrontendSettings(ready_timeout=60),
            )
        )
        for i in range(2)
    ]
    addrs = [f"127.0.0.1:{free_port()}" for _ in llms]
    # Runtime loads on, behind their own key, of adapters under the fixtures' directory only.
    admin = AdminSettings(
        enable_runtime_lora_updating=True,
        admin_api_key=ADMIN_KEY,
        allowed_local_paths=(str(tiny_model_dir.parent),),
    )
    servers = [
        loop.call(serve_frontend(llm, "127.0.0.1", int(a.rsplit(":", 1)[1]), api_key=API_KEY, admin=admin))
        for llm, a in zip(llms, addrs)
    ]
    url = loop.start_gateway(
        create_app(addrs, MODEL, load_tokenizer(str(tiny_model_dir)), api_key=API_KEY, admin=admin)
    )
    try:
        yield Stack(loop, llms, url, adapter_dirs)
    finally:
        loop.stop_stack(servers, llms)
        teardown(engines)


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        kv_cache_memory=64 * 1024 * 1024,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        log_stats_interval=0.0,
    )


def offline_text(offline: LLM, adapter: LoRARequest | None) -> str:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return offline.generate(PROMPT, params, lora_request=adapter, use_tqdm=False)[0].outputs[0].text


def complete(stack: Stack, model: str, **extra: Any) -> httpx.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{stack.url}/v1/completions", json=body, headers=AUTH, timeout=30)


def post(
    stack: Stack, path: str, body: dict[str, Any], headers: dict[str, str] = ADMIN_AUTH
) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, headers=headers, timeout=30)


def test_the_model_field_selects_an_adapter_and_the_output_is_the_offline_engines(
    stack: Stack, offline: LLM
) -> None:
    one = LoRARequest("one", 1, str(stack.adapters["one"]))
    for _ in range(2):  # both frontends (round-robin)
        response = complete(stack, "one")
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "one"
        assert response.json()["choices"][0]["text"] == offline_text(offline, one)
    base = complete(stack, MODEL).json()["choices"][0]["text"]
    assert base == offline_text(offline, None) != offline_text(offline, one)


def test_models_lists_the_adapters_with_their_parent(stack: Stack) -> None:
    cards = httpx.get(f"{stack.url}/v1/models", headers=AUTH).json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "one"]
    assert cards[1]["parent"] == MODEL and cards[1]["root"] == str(stack.adapters["one"])


def test_an_unknown_model_name_is_404(stack: Stack) -> None:
    response = complete(stack, "nope")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_need_the_admin_key_not_the_api_key(stack: Stack) -> None:
    body = {"lora_name": "two", "lora_path": str(stack.adapters["two"])}
    for headers in ({}, AUTH):
        assert post(stack, "/v1/load_lora_adapter", body, headers=headers).status_code == 401
        assert (
            post(stack, "/v1/unload_lora_adapter", {"lora_name": "one"}, headers=headers).status_code == 401
        )


def test_an_adapter_loaded_over_http_is_served_by_every_frontend_until_unloaded(
    stack: Stack, offline: LLM
) -> None:
    body = {"lora_name": "two", "lora_path": str(stack.adapters["two"])}
    response = post(stack, "/v1/load_lora_adapter", body)
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'two' added successfully."
    assert all(llm.loras is not None and llm.loras.get("two") is not None for llm in stack.llms)
    two = LoRARequest("two", 2, str(stack.adapters["two"]))
    for _ in range(2):
        assert complete(stack, "two").json()["choices"][0]["text"] == offline_text(offline, two)
    again = post(stack, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    response = post(stack, "/v1/unload_lora_adapter", {"lora_name": "two"})
    assert (
        response.status_code == 200 and response.text == "Success: LoRA adapter 'two' removed successfully."
    )
    assert complete(stack, "two").status_code == 404
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "two"}).status_code == 404


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"lora_name": "bad", "lora_path": "{allowed}/does-not-exist"}, "has no adapter_config.json"),
        ({"lora_name": "", "lora_path": "/x"}, "lora_name must be a non-empty string"),
        ({"lora_name": "big"}, "lora_path must be a non-empty string"),
    ],
)
def test_a_bad_load_is_400_and_changes_nothing(stack: Stack, body: dict[str, Any], message: str) -> None:
    allowed = str(stack.adapters["one"].parent)
    body = {k: v.format(allowed=allowed) for k, v in body.items()}
    response = post(stack, "/v1/load_lora_adapter", body)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert all(len(llm.loras.adapters()) == 1 for llm in stack.llms if llm.loras is not None)


def lora_info(stack: Stack) -> dict[str, str] | None:
    """The labels of the (one engine's) ``fastsched:lora_requests_info`` series."""
    page = parse_metrics(httpx.get(f"{stack.url}/metrics").text, 0.0)
    samples = page.samples.get("fastsched:lora_requests_info") or []
    if len(samples) != 1:
        return None
    labels = samples[0].labels
    return {k: labels[k] for k in ("max_lora", "running_lora_adapters", "waiting_lora_adapters")}


def test_an_adapter_in_use_is_not_unloaded(stack: Stack) -> None:
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/completions",
        headers=AUTH,
        timeout=60,
        json={
            "model": "one",
            "prompt": PROMPT,
            "max_tokens": 2000,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as stream:
        lines = stream.iter_lines()  # held: a dropped iterator closes the response
        next(lines)  # the request runs
        refused = post(stack, "/v1/unload_lora_adapter", {"lora_name": "one"})
        assert refused.status_code == 409 and "in flight" in refused.json()["error"]["message"]
        assert wait_for(
            lambda: (
                lora_info(stack)
                == {"max_lora": "2", "running_lora_adapters": "one", "waiting_lora_adapters": ""}
            ),
            timeout=10,
        )
    # The stream closed: its request is aborted and the adapter free again.
    assert wait_for(lambda: all(llm.loras.in_use("one") == 0 for llm in stack.llms), timeout=10)
    assert all(llm.loras is not None and llm.loras.get("one") is not None for llm in stack.llms), (
        "a refused unload leaves the adapter served by every frontend"
    )
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "one"}).status_code == 200
