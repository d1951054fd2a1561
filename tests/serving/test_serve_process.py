"""``fastsched serve`` as a user runs it (docs/design.md §1, §6, §7, §8): the real launcher in a
subprocess on the tiny model, checked from outside with the official ``openai`` client
and httpx only.

Servers are shared per flag set (module-scoped fixtures; each takes seconds to start)
and the last test of each stops it, so at most one runs at a time on a small machine:

- ``queued_reqs``: two frontends (K=2), ``--max-num-queued-reqs 4`` — the API, A2/A5,
  A6, aborts on disconnect; then Ctrl-C (SIGINT to the process group).
- ``queued_tokens_ft``: ``--max-num-queued-tokens 100 --enable-fault-tolerance`` — A3,
  then A1 after SIGKILL of its engine; then SIGTERM to the launcher.
- ``plain``: no limits — an engine's death without fault tolerance ends the launcher.

Two more tests start a server of their own: one SIGKILLs the launcher, one fails at
start-up.

Children's pids, the ipc directory and the shared-memory segment come from the
launcher's documented log lines (``fastsched.launcher.serve``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (requirements-serve.txt)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
openai = pytest.importorskip("openai", reason="openai is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from loop_thread import wait_for  # noqa: E402
from serve_process import ServeProcess, launch, metric_samples, pid_alive, start_serve  # noqa: E402

from fastsched.proto_gen import import_stubs  # noqa: E402

MODEL = "model"  # the tiny checkpoint's directory name: the served model name
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
QUEUED_REQS = 4
QUEUED_TOKENS = 100
SLOW_MAX_MODEL_LEN = 2048
SLOW_MAX_TOKENS = 2000  # a few seconds per request: in flight for the whole of a burst
REJECTED = 'fastsched:admission_rejections_total{reason="%s"}'


def _server(
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *args: str,
    api_server_count: int = 1,
    max_model_len: int = 256,
) -> Iterator[ServeProcess]:
    log = tmp_path_factory.mktemp(name) / "serve.log"
    server = start_serve(
        tiny_model_dir, log, *args, api_server_count=api_server_count, max_model_len=max_model_len
    )
    try:
        yield server
    finally:
        server.close()
        leftovers = [pid for pid in server.child_pids if pid_alive(pid)]
        assert not leftovers, f"processes outlived the server: {leftovers}\n{server.tail()}"


@pytest.fixture(scope="module")
def queued_reqs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    # The tiny model decodes ~1 ms/token on CPU: "slow" requests need thousands of tokens.
    yield from _server(
        tiny_model_dir,
        tmp_path_factory,
        "serve-queued-reqs",
        "--max-num-queued-reqs",
        str(QUEUED_REQS),
        "--enable-admin-api",  # /debug/requests
        api_server_count=2,
        max_model_len=SLOW_MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def queued_tokens_ft(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    yield from _server(
        tiny_model_dir,
        tmp_path_factory,
        "serve-queued-tokens",
        "--max-num-queued-tokens",
        str(QUEUED_TOKENS),
        "--enable-fault-tolerance",
    )


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    yield from _server(tiny_model_dir, tmp_path_factory, "serve-plain")


def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


async def _burst(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as http:
        return list(await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies)))


def burst(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """All ``bodies`` posted at once, concurrently."""
    return asyncio.run(_burst(url, bodies))


def assert_rejections(responses: list[httpx.Response], reason: str, max_tokens: int) -> int:
    """A5: every answer is 200 (complete) or 503 naming ``reason`` with Retry-After; returns the 503 count."""
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, [r.text for r in responses if r.status_code not in (200, 503)]
    for r in responses:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == reason, r.text
            assert reason in r.json()["error"]["message"]
            assert int(r.headers["Retry-After"]) >= 1
        else:
            body = r.json()
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == max_tokens
    return statuses.count(503)


def assert_gone(server: ServeProcess, children: list[int]) -> None:
    """No child outlives the launcher; the ipc directory and the shm segment are removed."""
    assert wait_for(lambda: not any(pid_alive(p) for p in children), timeout=5), (
        f"orphans: {[p for p in children if pid_alive(p)]}\n{server.tail()}"
    )
    assert not server.ipc_dir.exists(), f"ipc directory left: {list(server.ipc_dir.iterdir())}"
    assert not server.shm_path.exists(), f"shared-memory segment left: {server.shm_path}"


# ------------------------------------------------------------------ K=2, --max-num-queued-reqs 4


def test_serve_logs_every_process_and_serves_the_openai_api(queued_reqs: ServeProcess) -> None:
    log = queued_reqs.log()
    assert len(queued_reqs.engine_pids) == 1 and len(queued_reqs.frontend_pids) == 2
    for k, port in enumerate(queued_reqs.grpc_ports):
        assert f"frontend {k} serving gRPC on 127.0.0.1:{port}" in log
    assert f"gateway listening on {queued_reqs.url}" in log
    assert oct(queued_reqs.ipc_dir.stat().st_mode & 0o777) == "0o700"
    assert oct(queued_reqs.shm_path.stat().st_mode & 0o777) == "0o600"  # A6
    models = client(queued_reqs).models.list()
    assert [m.id for m in models.data] == [MODEL]
    # Quiet logs (issue 28): one ready line per engine, model info in short lines, the same
    # block count everywhere, probes left out of the access log, current flag names only.
    for _ in range(3):
        assert httpx.get(queued_reqs.url + "/health", timeout=30).status_code == 200
    assert wait_for(lambda: '"GET /v1/models HTTP/1.1" 200' in queued_reqs.log(), timeout=10)
    log = queued_reqs.log()
    assert log.count("engine 0 ready") == 1 and "ModelInfo(" not in log
    assert "GET /health" not in log
    [blocks] = set(re.findall(r"KV cache: (\d+) blocks", log))
    assert f"KV blocks={blocks}" in log
    assert "--kv-cache-memory " not in log and "--num-gpu-blocks " not in log


def test_serve_metrics_export_every_process_and_pass_promtool(queued_reqs: ServeProcess) -> None:
    """Issue 13: process_* for the gateway, each frontend and each engine (separate processes
    here), and a page promtool accepts but for vLLM's own names."""
    from promtool import lint_problems

    expected = (
        {("gateway", "0")}
        | {("frontend", str(i)) for i in range(len(queued_reqs.frontend_pids))}
        | {("engine", str(i)) for i in range(len(queued_reqs.engine_pids))}
    )

    def processes() -> set[tuple[str, str]]:
        return {
            tuple(re.findall(r'(?:index|process)="([^"]*)"', key))[::-1]
            for key in metric_samples(queued_reqs.url)
            if key.startswith("process_start_time_seconds{")
        }

    assert len(expected) == 4 and wait_for(lambda: processes() == expected, timeout=10), processes()
    samples = metric_samples(queued_reqs.url)
    starts = [v for k, v in samples.items() if k.startswith("process_start_time_seconds{")]
    assert all(abs(t - time.time()) < 3600 for t in starts)
    assert lint_problems(httpx.get(queued_reqs.url + "/metrics", timeout=10, trust_env=False).text) == []


def test_serve_completion_and_its_stream_agree(queued_reqs: ServeProcess) -> None:
    c = client(queued_reqs)
    out = c.completions.create(model=MODEL, prompt="def main():", max_tokens=12, **GREEDY)
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    chunks = list(
        c.completions.create(model=MODEL, prompt="def main():", max_tokens=12, stream=True, **GREEDY)
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_serve_chat_and_chat_stream(queued_reqs: ServeProcess) -> None:
    c = client(queued_reqs)
    messages = [{"role": "user", "content": "Write a queue class."}]
    out = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 8
    stream = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        == out.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == 8


def test_serve_a2_a5_burst_over_max_num_queued_reqs_gets_fast_503s(queued_reqs: ServeProcess) -> None:
    before = metric_samples(queued_reqs.url)[REJECTED % "max_num_queued_reqs"]
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    responses = burst(queued_reqs.url, [body] * 40)
    num_503 = assert_rejections(responses, "max_num_queued_reqs", max_tokens=32)
    assert 0 < num_503 < 40
    after = metric_samples(queued_reqs.url)
    assert after[REJECTED % "max_num_queued_reqs"] - before == num_503
    assert after[REJECTED % "max_num_queued_tokens"] == 0 and after[REJECTED % "engine_faulted"] == 0


def test_serve_a6_two_frontends_share_max_num_queued_reqs(queued_reqs: ServeProcess) -> None:
    """Slow requests sent at once to K=2 frontends: each frontend alone would admit up to
    4 of those it receives; sharing the counters, no more than 4 are in flight over both."""
    pb, pb_grpc = import_stubs()

    def received_per_frontend() -> list[int]:
        """Requests each frontend has rejected or completed."""
        out = []
        for port in queued_reqs.grpc_ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)]) as ch:
                stats = pb_grpc.FrontendStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)
            out.append(
                sum(stats.admission_rejections_total.values())
                + sum(stats.e2e_request_latency_seconds.bucket_counts)
            )
        return out

    before = received_per_frontend()
    in_flight_seen: list[float] = []
    done = False

    async def scenario() -> list[tuple[int, int]]:
        nonlocal done
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=queued_reqs.url, timeout=120, limits=limits, trust_env=False
        ) as http:

            async def slow() -> tuple[int, int]:
                body = {
                    "model": MODEL,
                    "prompt": "class Queue:",
                    "max_tokens": SLOW_MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                    if r.status_code != 200 or events[-1] != "[DONE]":
                        return r.status_code, 0
                    return r.status_code, json.loads(events[-2])["usage"]["completion_tokens"]

            async def watch() -> None:
                while not done:
                    m = (await http.get("/metrics")).text
                    in_flight_seen.append(
                        sum(
                            float(line.rsplit(" ", 1)[1])
                            for line in m.splitlines()
                            if line.startswith(
                                ("fastsched:num_requests_running", "fastsched:num_requests_waiting")
                            )
                        )
                    )
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            try:
                return list(await asyncio.gather(*(slow() for _ in range(16))))
            finally:
                done = True
                await watcher

    start = time.monotonic()
    results = asyncio.run(scenario())
    elapsed = time.monotonic() - start
    accepted = [n for status, n in results if status == 200]
    assert 1 <= len(accepted) <= QUEUED_REQS, (results, elapsed)
    assert accepted == [SLOW_MAX_TOKENS] * len(accepted)  # every accepted request streamed to its end
    assert [status for status, _ in results].count(503) == 16 - len(accepted)
    assert in_flight_seen and 1 <= max(in_flight_seen) <= QUEUED_REQS, in_flight_seen
    received = [a - b for a, b in zip(received_per_frontend(), before)]
    assert sum(received) == 16, received
    # Without sharing each frontend would have admitted min(4, what it received): more than 4 in all.
    assert sum(min(QUEUED_REQS, r) for r in received) > QUEUED_REQS, received


def _prompt_status(url: str, request_id: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/debug/requests/{request_id}", timeout=10, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["prompts"][0]


def test_serve_s18_client_disconnect_mid_stream_aborts_and_frees_the_kv_cache(
    queued_reqs: ServeProcess,
) -> None:
    url = queued_reqs.url
    body = {
        "model": MODEL,
        "prompt": "class Queue:",
        "max_tokens": SLOW_MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    # On a loaded machine the engine could finish a request before its first chunk reaches
    # the client; only a disconnect while it still runs tests the abort, so retry if not.
    for attempt in range(3):
        request_id = f"s18-disconnect-{os.getpid()}-{attempt}"
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
            with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                r.close()  # the client goes away mid-stream

        def ended() -> bool:
            return _prompt_status(url, request_id)["state"] == "finished"

        assert wait_for(ended, timeout=10), _prompt_status(url, request_id)
        sequence = _prompt_status(url, request_id)["sequences"][0]
        if sequence["finish_reason"] == "abort":
            break
    else:
        pytest.fail(f"every request ran to the end before its client disconnected: {sequence}")
    assert sequence["num_output_tokens"] < SLOW_MAX_TOKENS

    def idle() -> bool:
        m = metric_samples(url)
        return (
            m["fastsched:kv_cache_usage_perc"] == 0
            and m["fastsched:num_requests_running"] == 0
            and m["fastsched:num_requests_waiting"] == 0
        )

    assert wait_for(idle, timeout=30), metric_samples(url)


def test_serve_ctrl_c_stops_gateway_then_frontends_then_engines_and_cleans_up(
    queued_reqs: ServeProcess,
) -> None:
    """Ctrl-C in a terminal signals the whole process group: only the launcher acts on
    it, so the order holds (the engine is asked to stop only after the frontends)."""
    children = queued_reqs.child_pids
    start = time.monotonic()
    os.killpg(queued_reqs.proc.pid, signal.SIGINT)
    assert queued_reqs.wait(timeout=10) == 0, queued_reqs.tail()
    assert time.monotonic() - start < 10
    assert_gone(queued_reqs, children)
    log = queued_reqs.log()
    steps = [
        "shutting down (signal)",
        "gateway stopped",
        "frontends stopped",
        "engine 0: stop requested",
        "engines stopped",
    ]
    positions = [log.find(step) for step in steps]
    assert -1 not in positions and positions == sorted(positions), queued_reqs.tail()
    # Issue 37: every Ctrl-C ended with multiprocessing's resource tracker (the group's last
    # process) reporting a leaked semaphore (tqdm's lock, taken in the engine).
    assert wait_for(lambda: not _group_alive(queued_reqs.proc.pid), timeout=30), "the resource tracker exits"
    assert "leaked" not in queued_reqs.log(), queued_reqs.tail()


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group ``pgid`` remains (/proc, Linux)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            return True
    return False


# ------------------------------------------------------------------ --max-num-queued-tokens, fault tolerance


def test_serve_a3_burst_over_max_num_queued_tokens_gets_fast_503s(queued_tokens_ft: ServeProcess) -> None:
    url = queued_tokens_ft.url
    before = metric_samples(url)[REJECTED % "max_num_queued_tokens"]
    bodies = [
        {
            "model": MODEL,
            "prompt": [10 + (i + j) % 200 for j in range(60)],
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        for i in range(40)
    ]
    responses = burst(url, bodies)
    num_503 = assert_rejections(responses, "max_num_queued_tokens", max_tokens=8)
    assert 0 < num_503 < 40
    after = metric_samples(url)
    assert after[REJECTED % "max_num_queued_tokens"] - before == num_503
    assert after[REJECTED % "max_num_queued_reqs"] == 0


def test_serve_a1_engine_killed_turns_health_and_requests_to_503(queued_tokens_ft: ServeProcess) -> None:
    url = queued_tokens_ft.url
    (engine_pid,) = queued_tokens_ft.engine_pids
    killed = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)

    def unhealthy() -> bool:
        return httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 503

    assert wait_for(unhealthy, timeout=10), queued_tokens_ft.tail()
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 4}
    r = httpx.post(url + "/v1/completions", json=body, timeout=10, trust_env=False)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_faulted", r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert time.monotonic() - killed < 10  # no hang
    with pytest.raises(openai.InternalServerError) as info:  # the official client sees the 503 too
        client(queued_tokens_ft).completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert info.value.status_code == 503
    assert metric_samples(url)[REJECTED % "engine_faulted"] >= 2
    assert (
        queued_tokens_ft.proc.poll() is None
    )  # fault tolerance: the server stays up (restarting the engine)


def test_serve_sigterm_after_engine_death_still_cleans_up(queued_tokens_ft: ServeProcess) -> None:
    children = queued_tokens_ft.child_pids
    assert queued_tokens_ft.terminate(timeout=10) == 0, queued_tokens_ft.tail()
    assert_gone(queued_tokens_ft, children)


# ------------------------------------------------------------------ no fault tolerance


def test_serve_engine_death_without_fault_tolerance_ends_the_launcher(plain: ServeProcess) -> None:
    children = plain.child_pids
    os.kill(plain.engine_pids[0], signal.SIGKILL)
    code = plain.wait(timeout=15)
    assert code == 1, plain.tail()
    assert "engine 0" in plain.log() and "exited unexpectedly" in plain.log()
    assert_gone(plain, children)


def test_serve_launcher_killed_children_exit_and_stale_files_are_removed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from fastsched.launcher.serve import remove_stale

    server = start_serve(tiny_model_dir, tmp_path / "serve.log")
    try:
        children = server.child_pids
        server.proc.kill()  # SIGKILL: no clean-up at all
        server.wait(timeout=10)
        assert wait_for(lambda: not any(pid_alive(p) for p in children), timeout=10), server.tail()
        assert server.shm_path.exists() and server.ipc_dir.exists()
        # A6: what a crashed launcher left is removed by the next one (it calls this at start-up).
        removed = remove_stale()
        assert str(server.shm_path) in removed and str(server.ipc_dir) in removed
        assert_gone(server, children)
    finally:
        server.close()


def test_serve_child_failing_at_start_up_fails_the_launcher(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Only an engine, with the model loaded, can tell (what needs no model is refused before any spawn).
    server = launch(tiny_model_dir, tmp_path / "serve.log", "--max-model-len", "1000000")
    try:
        code = server.wait(timeout=90)
        assert code == 1, server.tail()
        assert "max_model_len (1000000) is greater than the model's max_position_embeddings" in server.log()
        assert "fastsched serve: error:" in server.log()
        assert server.child_pids  # it got as far as starting them
        assert_gone(server, server.child_pids)
    finally:
        server.close()


def test_serve_two_instances_with_grpc_port_0_pick_free_ports_and_log_requests(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``--grpc-port 0``: each instance picks free gRPC ports and logs them, so two run side by side."""
    servers = []
    try:
        for name, extra in (("a", ("--enable-log-requests", "--max-log-len", "3")), ("b", ())):
            servers.append(start_serve(tiny_model_dir, tmp_path / f"{name}.log", "--grpc-port", "0", *extra))
        ports = []
        for server in servers:
            logged = server._find(r"--grpc-port 0: frontends will listen on ports \[(\d+)\]")
            assert logged, server.tail()
            ports.append(int(logged[0]))
            assert f"frontend 0 serving gRPC on 127.0.0.1:{ports[-1]}" in server.log()
            reply = httpx.post(
                server.url + "/v1/completions",
                timeout=60,
                trust_env=False,
                json={"prompt": "Hello", "max_tokens": 2},
            )
            assert reply.status_code == 200, reply.text
        assert ports[0] != ports[1]
        # --enable-log-requests on "a" only, prompts cut to --max-log-len
        logged = wait_for(lambda: "Finished request" in servers[0].log(), timeout=10)
        assert logged, servers[0].tail()
        assert "Received request" in servers[0].log() and "prompt: 'Hel'," in servers[0].log()
        assert "Received request" not in servers[1].log()
    finally:
        for server in servers:
            server.close()
