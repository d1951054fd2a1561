"""Supervision by ``fastsched serve`` (issue 11 defect 3; docs/serving.md "Supervision"):
the launcher watches its children for exit *and* liveness. A hung engine (SIGSTOP) used
to leave the server answering 503 engine_faulted forever while the launcher stayed up;
with --enable-fault-tolerance a dead engine was never replaced and its gauges froze.

Each test starts its own server on the tiny model, with a short --engine-timeout so that
a hang is noticed in seconds. The fault-tolerant server takes its API key from
FASTSCHED_API_KEY (never on its command line) and requires it on the gRPC port too.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from loop_thread import wait_for  # noqa: E402
from serve_process import ServeProcess, metric_samples, pid_alive, start_serve  # noqa: E402

from fastsched.proto_gen import import_stubs  # noqa: E402

pb, pb_grpc = import_stubs()

MODEL = "model"
KEY = "sk-supervision-key"
ENGINE_TIMEOUT = "2"
EXIT_WITHIN_S = 30.0  # detection (engine_timeout 2 s + a probe) and an orderly shutdown
RESTART_WITHIN_S = 90.0  # back-off, a new process importing torch and loading the model, READY


def _serve(
    tiny_model_dir: Path,
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    max_model_len: int = 256,
) -> ServeProcess:
    return start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--engine-timeout",
        ENGINE_TIMEOUT,
        *args,
        env=env,
        max_model_len=max_model_len,
    )


@pytest.fixture
def fault_tolerant(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServeProcess]:
    server = _serve(
        tiny_model_dir,
        tmp_path,
        "--enable-fault-tolerance",
        "--max-engine-restarts",
        "2",
        env={"FASTSCHED_API_KEY": KEY},
        max_model_len=4096,
    )
    try:
        yield server
    finally:
        server.close()
        assert not [pid for pid in server.child_pids if pid_alive(pid)], server.tail()


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=5, trust_env=False).status_code
    except httpx.HTTPError:
        return 0


def _complete(url: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "import os", "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
        trust_env=False,
    )


def _wait_restarted(server: ServeProcess, restarts: int) -> float:
    """Seconds until the launcher logs the engine's ``restarts``-th restart and /health is 200."""
    start = time.monotonic()
    assert wait_for(
        lambda: server.log().count("engine 0 restarted") >= restarts and _health(server.url) == 200,
        timeout=RESTART_WITHIN_S,
    ), server.tail()
    return time.monotonic() - start


def test_fault_tolerance_restarts_a_killed_then_a_hung_engine_and_gives_up_after_max_restarts(
    fault_tolerant: ServeProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fault_tolerant
    assert KEY not in Path(f"/proc/{server.proc.pid}/cmdline").read_text()
    assert _complete(server.url).status_code == 200
    before = metric_samples(server.url)
    assert before["fastsched:num_requests_running"] == 0

    # SIGKILL: in-flight requests end with a retryable 503, then a new engine serves.
    (engine,) = server.engine_pids
    os.kill(engine, signal.SIGKILL)
    assert wait_for(lambda: _health(server.url) == 503, timeout=15), server.tail()
    response = _complete(server.url)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_faulted", response.text
    killed_restart_s = _wait_restarted(server, 1)
    assert _complete(server.url).status_code == 200

    # SIGSTOP mid-stream: the frontends find it silent; its frozen gauges (1 running) leave
    # /metrics and the stream ends with a retryable error; the launcher kills it (SIGCONT
    # is too late) and restarts it.
    engine = server.engine_pids[-1]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json=body,
        timeout=60,
        trust_env=False,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(engine, signal.SIGSTOP)
        assert wait_for(
            lambda: metric_samples(server.url).get("fastsched:num_requests_running", 0.0) == 0,
            timeout=EXIT_WITHIN_S,
        ), server.tail()
        rest = list(lines)
    assert any("engine_faulted" in line for line in rest), rest
    hung_restart_s = _wait_restarted(server, 2)
    if pid_alive(engine):
        os.kill(engine, signal.SIGCONT)
    assert not pid_alive(engine)
    assert _complete(server.url).status_code == 200
    samples = metric_samples(server.url)
    # A dead engine exports no per-engine series at all; a live idle one exports zeros.
    assert samples.get("fastsched:num_requests_running", 0.0) == 0
    assert samples.get("fastsched:kv_cache_usage_perc", 0.0) == 0
    with capsys.disabled():
        print(
            f"\nengine restart: {killed_restart_s:.1f} s after SIGKILL, {hung_restart_s:.1f} s after SIGSTOP"
        )

    # A third failure is over --max-engine-restarts 2: the server exits non-zero.
    os.kill(server.engine_pids[-1], signal.SIGKILL)
    assert server.wait(RESTART_WITHIN_S) == 1, server.tail()
    assert "--max-engine-restarts" in server.log()


def test_hung_engine_without_fault_tolerance_ends_the_server_non_zero(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = _serve(tiny_model_dir, tmp_path)
    try:
        children = server.child_pids
        os.kill(server.engine_pids[0], signal.SIGSTOP)
        assert server.wait(EXIT_WITHIN_S) == 1, server.tail()
        assert "reported dead by a frontend" in server.log()
        assert wait_for(lambda: not any(pid_alive(p) for p in children), timeout=10)
    finally:
        server.close()


def test_hung_frontend_ends_the_server_non_zero(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = _serve(tiny_model_dir, tmp_path, "--enable-fault-tolerance")
    try:
        children = server.child_pids
        os.kill(server.frontend_pids[0], signal.SIGSTOP)
        assert server.wait(EXIT_WITHIN_S) == 1, server.tail()
        assert "frontend 0" in server.log() and "is hung" in server.log()
        assert wait_for(lambda: not any(pid_alive(p) for p in children), timeout=10)
    finally:
        server.close()


def test_api_key_file_guards_http_and_grpc(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 11 defect 5: the key could only be given on the command line, and the gRPC
    port ignored it."""
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    server = _serve(tiny_model_dir, tmp_path, "--api-key-file", str(key_file))
    try:
        assert httpx.get(server.url + "/v1/models", timeout=10, trust_env=False).status_code == 401
        assert _complete(server.url).status_code == 200
        with grpc.insecure_channel(
            f"127.0.0.1:{server.grpc_ports[0]}", options=[("grpc.enable_http_proxy", 0)]
        ) as channel:
            stub = pb_grpc.FrontendStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (
                stub.ModelInfo(
                    pb.ModelInfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {KEY}"),)
                ).max_model_len
                == 256
            )
    finally:
        server.close()
