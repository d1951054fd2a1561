"""S7 ``remote_kv`` as a user meets it: ``fastsched serve --kv-transfer-config`` twice on
one store. The restarted server answers the same greedy completion with fewer tokens
computed (``fastsched:iteration_tokens_total``'s sum) and shows the loads in /metrics."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from loop_thread import wait_for  # noqa: E402
from serve_process import metric_samples, start_serve  # noqa: E402

SAVED = "fastsched:kv_connector_blocks_saved_total"
PROMPT = "the quick brown fox jumps over the lazy dog " * 8  # a few blocks of 16 tokens on the tiny model


def complete(url: str) -> str:
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def serve_once(tiny_model_dir: Path, log: Path, store: Path, saves: bool) -> tuple[str, dict[str, float]]:
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    server = start_serve(tiny_model_dir, log, "--kv-transfer-config", json.dumps(kv))
    try:
        text = complete(server.url)
        if saves:  # written in the background: their count arrives with a later heartbeat
            assert wait_for(lambda: metric_samples(server.url).get(SAVED, 0) > 0, timeout=30)
        metrics = metric_samples(server.url)
        assert server.terminate() == 0, server.tail()  # the engine waits for its saves
    finally:
        server.close()
    return text, metrics


def test_s7_a_restarted_server_loads_the_prompt_from_the_store(tiny_model_dir, tmp_path) -> None:
    cold_text, cold = serve_once(tiny_model_dir, tmp_path / "cold.log", tmp_path / "store", saves=True)
    warm_text, warm = serve_once(tiny_model_dir, tmp_path / "warm.log", tmp_path / "store", saves=False)
    assert warm_text == cold_text
    assert cold["fastsched:kv_connector_blocks_loaded_total"] == 0
    loaded = warm["fastsched:kv_connector_blocks_loaded_total"]
    assert loaded > 0 and warm["fastsched:kv_connector_hits_total"] == 1
    saved_tokens = cold["fastsched:iteration_tokens_total_sum"] - warm["fastsched:iteration_tokens_total_sum"]
    assert saved_tokens == loaded * 16


def engine_value(url: str, name: str, engine: str) -> float:
    """One engine's sample of a family (``metric_samples`` sums the engines)."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and f'engine="{engine}"' in line
    )


def test_s7_the_engines_of_one_server_share_a_prefix_through_the_store(tiny_model_dir, tmp_path) -> None:
    """Engine 0 computes the prompt alone. Then two requests with its prefix arrive together:
    the router sends one to each engine (``--routing load``: least loaded), and engine 1 loads the prefix from the store."""
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "store")},
    }
    server = start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--kv-transfer-config",
        json.dumps(kv),
        "--data-parallel-size",
        "2",
        "--routing",
        "load",
        max_model_len=2048,
    )
    try:
        complete(server.url)  # both engines idle: engine 0
        assert wait_for(lambda: engine_value(server.url, SAVED, "0") > 0, timeout=30)
        # Long enough that the first is still decoding when the second is routed.
        body = {
            "model": "model",
            "prompt": PROMPT + "and then?",
            "max_tokens": 1500,
            "temperature": 0,
            "ignore_eos": True,
        }
        with ThreadPoolExecutor(2) as pool:
            replies = list(
                pool.map(
                    lambda _: httpx.post(
                        server.url + "/v1/completions", json=body, timeout=120, trust_env=False
                    ),
                    range(2),
                )
            )
        assert all(r.is_success for r in replies)
        assert replies[0].json()["choices"][0]["text"] == replies[1].json()["choices"][0]["text"]
        loaded = "fastsched:kv_connector_blocks_loaded_total"
        assert wait_for(lambda: engine_value(server.url, loaded, "1") > 0, timeout=30)
        assert engine_value(server.url, loaded, "0") == 0, "engine 0 had the prefix in its own cache"
    finally:
        server.close()
