"""``fastsched serve --tensor-parallel-size 2`` (issue 24; docs/deploy.md "Tensor
parallelism"): the served greedy tokens are those of the unsharded model offline, also
with heads that split unevenly, with two data-parallel engines of two ranks each and with
LoRA adapters; the layout is in the start-up log and in ``cache_config_info``; a killed
worker, or a hung one (stopped: past ``--execute-model-timeout``), ends the server non-zero
with every process gone, and so does SIGTERM, cleanly.
"""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")
pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")

from loop_thread import wait_for  # noqa: E402
from serve_process import ServeProcess, metric_samples, pid_alive, start_serve  # noqa: E402

from fastsched import LLM, SamplingParams  # noqa: E402
from fastsched.lora import LoRARequest  # noqa: E402
from fastsched.tools.tiny_lora import make_tiny_lora  # noqa: E402
from fastsched.tools.tiny_model import make_tiny_model  # noqa: E402

PROMPTS = [[5, 77, 300, 12, 9, 41], list(range(40, 90))]
MAX_TOKENS = 12
EXIT_WITHIN_S = 30.0


def _offline_texts(model_dir: Path, prompts: list[list[int]]) -> list[str]:
    offline = LLM(
        model=str(model_dir), dtype="float32", log_stats_interval=0, num_threads=1, max_model_len=256
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]


def _complete(url: str, prompt: list[int]) -> str:
    response = httpx.post(
        url + "/v1/completions",
        timeout=120,
        trust_env=False,
        json={
            "model": "model",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _worker_pids(log: str) -> list[int]:
    found = re.findall(
        r"parallel layout: tensor_parallel_size=2 \(mp; gloo; ranks 1.. pids \[([\d, ]+)\]\)", log
    )
    return [int(p) for p in found[0].split(",")] if found else []


def test_tp2_serve_gives_the_unsharded_greedy_tokens_and_a_killed_worker_ends_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    expected = _offline_texts(tiny_model_dir, PROMPTS)
    server = start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--tensor-parallel-size",
        "2",
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "8",
    )
    try:
        workers = _worker_pids(server.log())
        assert len(workers) == 1, server.tail()
        assert [_complete(server.url, prompt) for prompt in PROMPTS] == expected
        info = [k for k in metric_samples(server.url) if k.startswith("fastsched:cache_config_info")]
        assert info and 'tensor_parallel_size="2"' in info[0]
        children = server.child_pids
        os.kill(workers[0], signal.SIGKILL)
        code = server.wait(EXIT_WITHIN_S)
        assert code not in (None, 0), server.tail()
        assert "tensor parallel worker rank 1" in server.log()
        assert wait_for(lambda: not any(pid_alive(p) for p in [*children, *workers]), timeout=10)
    finally:
        server.close()


def test_tp2_serve_applies_a_lora_adapter_as_one_rank_does(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The OpenAI ``model`` field names the adapter; the worker reads its slices from the path."""
    adapter = make_tiny_lora(tiny_model_dir, tmp_path / "lora", rank=8, seed=3)
    offline = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        log_stats_interval=0,
        num_threads=1,
        max_model_len=256,
        enable_lora=True,
        max_lora_rank=8,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = LoRARequest("adapter", 1, str(adapter))
    expected = [
        o.outputs[0].text for o in offline.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)
    ]
    base = [o.outputs[0].text for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    assert expected != base
    server = start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--tensor-parallel-size",
        "2",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"adapter={adapter}",
    )
    try:
        for prompt, text in zip(PROMPTS, expected, strict=True):
            response = httpx.post(
                server.url + "/v1/completions",
                timeout=60,
                trust_env=False,
                json={
                    "model": "adapter",
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text
        assert server.terminate() == 0, server.tail()
    finally:
        server.close()


def test_a_hung_worker_ends_the_server_after_the_execute_model_timeout_with_every_process_gone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGSTOP leaves the worker alive but silent: the next step's all-reduce waits for it
    until the step watch (``--execute-model-timeout 5``) kills the workers and the engine fails."""
    server = start_serve(
        tiny_model_dir, tmp_path / "serve.log", "--tensor-parallel-size", "2", "--execute-model-timeout", "5"
    )
    (worker,) = _worker_pids(server.log())
    try:
        children = server.child_pids
        os.kill(worker, signal.SIGSTOP)
        with pytest.raises(httpx.HTTPError):  # no answer; the server goes away meanwhile
            response = httpx.post(
                server.url + "/v1/completions",
                timeout=EXIT_WITHIN_S,
                trust_env=False,
                json={"model": "model", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
            )
            response.raise_for_status()
        code = server.wait(EXIT_WITHIN_S)
        assert code not in (None, 0), server.tail()
        assert f"execute-model-timeout): a worker hangs; stopped worker pids [{worker}]" in server.log()
        assert wait_for(lambda: not any(pid_alive(p) for p in [*children, worker]), timeout=10)
    finally:
        if pid_alive(worker):
            os.kill(worker, signal.SIGCONT)
            os.kill(worker, signal.SIGKILL)
        server.close()


def test_with_fault_tolerance_a_killed_worker_restarts_the_engine_with_new_workers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--tensor-parallel-size",
        "2",
        "--max-num-seqs",
        "8",
        "--enable-fault-tolerance",
        "--max-engine-restarts",
        "1",
    )
    try:
        (first,) = _worker_pids(server.log())
        os.kill(first, signal.SIGKILL)
        second = _restarted_worker(server)
        assert second != first and pid_alive(second)
        _complete_then_stop(server, second)
    finally:
        server.close()


def test_with_fault_tolerance_a_hung_worker_restarts_the_engine_with_new_workers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--tensor-parallel-size",
        "2",
        "--execute-model-timeout",
        "5",
        "--enable-fault-tolerance",
        "--max-engine-restarts",
        "1",
    )
    (first,) = _worker_pids(server.log())
    try:
        os.kill(first, signal.SIGSTOP)
        with pytest.raises(httpx.HTTPError):  # the request of the failed step is not retried
            httpx.post(
                server.url + "/v1/completions",
                timeout=EXIT_WITHIN_S,
                trust_env=False,
                json={"model": "model", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
            ).raise_for_status()
        second = _restarted_worker(server)
        assert not pid_alive(first) and pid_alive(second)
        _complete_then_stop(server, second)
    finally:
        if pid_alive(first):
            os.kill(first, signal.SIGCONT)
            os.kill(first, signal.SIGKILL)
        server.close()


def _restarted_worker(server: ServeProcess) -> int:
    """Waits until the engine has restarted with a new worker and serves; its pid."""
    assert wait_for(lambda: len(_all_worker_pids(server.log())) == 2 and _healthy(server.url), timeout=90), (
        server.tail()
    )
    return _all_worker_pids(server.log())[1]


def _complete_then_stop(server: ServeProcess, worker: int) -> None:
    """A completion succeeds, then SIGTERM stops the server with every child and ``worker`` gone."""
    response = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        trust_env=False,
        json={"model": "model", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    children = server.child_pids
    assert server.terminate() == 0, server.tail()
    assert wait_for(lambda: not any(pid_alive(p) for p in [*children, worker]), timeout=10)


def _all_worker_pids(log: str) -> list[int]:
    return [
        int(p)
        for p in re.findall(
            r"parallel layout: tensor_parallel_size=2 \(mp; gloo; ranks 1.. pids \[(\d+)\]\)", log
        )
    ]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def uneven_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query heads over 3 KV heads: over 2 ranks, 4 + 2 query heads and 2 + 1 KV heads."""
    return make_tiny_model(
        tmp_path_factory.mktemp("uneven") / "model", hidden_size=96, num_heads=6, num_kv_heads=3
    )


def test_dp2_tp2_serve_with_uneven_heads_gives_the_unsharded_tokens_and_sigterm_leaves_no_process(
    uneven_model_dir: Path, tmp_path: Path
) -> None:
    """Two engines of two ranks each (4 model processes), heads split 4+2 / 2+1 on each: every
    request, whichever engine serves it, gets the greedy tokens of one unsharded model."""
    prompts = [*PROMPTS, [7, 8, 9, 10] * 5, list(range(200, 233))]
    expected = _offline_texts(uneven_model_dir, prompts)
    server = start_serve(
        uneven_model_dir,
        tmp_path / "serve.log",
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "8",
    )
    try:
        workers = [
            int(p)
            for p in re.findall(
                r"parallel layout: tensor_parallel_size=2 \(mp; gloo; ranks 1.. "
                r"pids \[(\d+)\]\)",
                server.log(),
            )
        ]
        assert len(workers) == 2 and len(set(workers)) == 2, server.tail()
        assert server.log().count("tensor parallel heads: rank 0 q 0-3 kv 0-1; rank 1 q 4-5 kv 2") == 2
        with ThreadPoolExecutor(len(prompts)) as pool:  # in flight together: both engines take some
            assert list(pool.map(lambda p: _complete(server.url, p), prompts)) == expected
        info = [k for k in metric_samples(server.url) if k.startswith("fastsched:cache_config_info")]
        assert info and 'num_heads_per_rank="4,2"' in info[0] and 'num_kv_heads_per_rank="2,1"' in info[0]
        children = server.child_pids
        assert server.terminate() == 0, server.tail()
        assert wait_for(lambda: not any(pid_alive(p) for p in [*children, *workers]), timeout=10)
    finally:
        server.close()
