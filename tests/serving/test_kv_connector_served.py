"""S7 ``remote_kv`` as a user meets it: ``fastsched serve --kv-transfer-config`` twice on
one store. The restarted server answers the same greedy completion with fewer tokens
computed (``fastsched:iteration_tokens_total``'s sum) and shows the loads in /metrics."""

from __future__ import annotations

import json
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
    kv = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(store)}}
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
