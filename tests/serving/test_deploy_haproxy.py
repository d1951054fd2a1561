"""deploy/haproxy/haproxy.cfg, as checked in, in front of two real ``fastsched serve``
replicas on loopback (docs/deploy.md): health checks on /health, leastconn, a 503 (a
replica's admission is full) retried on the other replica, a SIGKILLed replica taken out
of the rotation without a failed request, SSE streams passing through, and the admin
routes and /metrics refused from outside (403) while the public API passes.

Each replica admits at most ``QUEUED_REQS`` requests (--max-num-queued-reqs), so a burst
of ``BURST`` concurrent requests is above one replica's limit and below two's: the
client must see no 503. HAProxy is installed with apt-get when missing (as root).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("starlette", reason="starlette is not installed (requirements-serve.txt)")

from loop_thread import free_port, wait_for  # noqa: E402
from serve_process import ServeProcess, launch, metric_samples, pid_alive, wait_healthy  # noqa: E402
from system_packages import require  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy" / "haproxy.cfg"
MODEL = "model"
QUEUED_REQS = 2
BURST = 3
ROUNDS = 3
DOWN_WITHIN_S = 5.0  # inter 1 s x fall 2, and a margin


@dataclass
class Balancer:
    url: str
    stats_url: str
    replicas: list[ServeProcess]
    proc: subprocess.Popen

    def stats(self) -> dict[str, dict[str, str]]:
        """HAProxy's stats CSV, by ``<proxy>/<server>``."""
        text = httpx.get(self.stats_url + "/stats;csv", timeout=5, trust_env=False).text.lstrip("# ")
        return {f"{row['pxname']}/{row['svname']}": row for row in csv.DictReader(io.StringIO(text))}


@pytest.fixture(scope="module")
def balancer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Balancer]:
    haproxy = require("haproxy", "haproxy")
    logs = tmp_path_factory.mktemp("haproxy")
    args = ("--max-num-queued-reqs", str(QUEUED_REQS))
    replicas = [launch(tiny_model_dir, logs / f"replica{i}.log", *args, max_model_len=2048) for i in (1, 2)]
    proc = None
    try:
        for server in replicas:  # started together, waited for one after the other
            wait_healthy(server)
        port, stats_port = free_port(), free_port()
        env = dict(
            os.environ,
            FASTSCHED_LB_BIND=f"127.0.0.1:{port}",
            FASTSCHED_LB_STATS_BIND=f"127.0.0.1:{stats_port}",
            FASTSCHED_REPLICA1=replicas[0].url.removeprefix("http://"),
            FASTSCHED_REPLICA2=replicas[1].url.removeprefix("http://"),
        )
        check = subprocess.run([haproxy, "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(logs / "haproxy.log", "wb") as log:
            proc = subprocess.Popen(
                [haproxy, "-db", "-f", str(CONFIG)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        lb = Balancer(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{stats_port}", replicas, proc)

        def both_up() -> bool:
            try:
                return all(lb.stats()[f"fastsched/replica{i}"]["status"] == "UP" for i in (1, 2))
            except (httpx.HTTPError, KeyError):
                return False

        assert wait_for(both_up, timeout=30), (logs / "haproxy.log").read_text()
        yield lb
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        for server in replicas:
            server.close()
        assert not [pid for server in replicas for pid in server.child_pids if pid_alive(pid)]


def _body(max_tokens: int, **extra: object) -> dict:
    return {
        "model": MODEL,
        "prompt": "def main():",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        **extra,
    }


async def _burst(url: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(
        base_url=url, timeout=120, trust_env=False, limits=httpx.Limits(max_connections=None)
    ) as http:
        return list(
            await asyncio.gather(*(http.post("/v1/completions", json=_body(1500)) for _ in range(count)))
        )


def test_haproxy_burst_above_one_replicas_limit_gets_no_503(
    balancer: Balancer, capsys: pytest.CaptureFixture[str]
) -> None:
    statuses: list[int] = []
    for _ in range(ROUNDS):
        statuses += [r.status_code for r in asyncio.run(_burst(balancer.url, BURST))]
    backend = balancer.stats()["fastsched/BACKEND"]
    with capsys.disabled():
        print(
            f"\nhaproxy: {len(statuses)} requests in bursts of {BURST} (limit {QUEUED_REQS} per replica): "
            f"{statuses.count(503)} x 503 at the client, {backend['wretr']} retries, "
            f"{backend['wredis']} redispatches"
        )
    assert statuses == [200] * len(statuses), statuses


async def _behind_its_back(balancer: Balancer) -> tuple[list[int], list[int]]:
    """Fills replica 1's admission with requests sent to it directly (HAProxy does not
    count them), then sends ``QUEUED_REQS`` requests through HAProxy."""
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        direct = [
            asyncio.ensure_future(http.post(balancer.replicas[0].url + "/v1/completions", json=_body(2000)))
            for _ in range(QUEUED_REQS)
        ]
        await asyncio.sleep(0.1)
        through = await asyncio.gather(
            *(http.post(balancer.url + "/v1/completions", json=_body(200)) for _ in range(QUEUED_REQS))
        )
        return [r.status_code for r in await asyncio.gather(*direct)], [r.status_code for r in through]


def test_haproxy_retries_a_full_replicas_503_on_the_other(
    balancer: Balancer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A replica whose admission is full answers 503 (A2); HAProxy retries it elsewhere."""
    rejected = 'fastsched:admission_rejections_total{reason="max_num_queued_reqs"}'
    retries_before = int(balancer.stats()["fastsched/BACKEND"]["wretr"])
    rejected_before = metric_samples(balancer.replicas[0].url)[rejected]
    direct, through = asyncio.run(_behind_its_back(balancer))
    retries = int(balancer.stats()["fastsched/BACKEND"]["wretr"]) - retries_before
    rejections = metric_samples(balancer.replicas[0].url)[rejected] - rejected_before
    with capsys.disabled():
        print(
            f"\nhaproxy: replica 1 full; {len(through)} requests through HAProxy: {through.count(503)} x 503 at "
            f"the client, {int(rejections)} rejected by replica 1 and retried ({retries} retries)"
        )
    assert direct == [200] * QUEUED_REQS
    assert through == [200] * QUEUED_REQS
    assert retries >= rejections


def test_haproxy_streams_pass_through(balancer: Balancer) -> None:
    with httpx.stream(
        "POST", balancer.url + "/v1/completions", json=_body(50, stream=True), timeout=60, trust_env=False
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"


ADMIN_PATHS = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/reload_weights"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/debug/requests/x"),
    ("GET", "/metrics"),
    ("POST", "/%70ause"),
    ("POST", "//pause"),
    ("POST", "/v1/../pause"),
    ("GET", "/DEBUG/requests/x"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_PATHS)
def test_haproxy_denies_admin_routes_from_outside(balancer: Balancer, method: str, path: str) -> None:
    """Issue 22: the admin API is for the replicas' own network; through the balancer, 403."""
    response = httpx.request(method, balancer.url + path, json={}, timeout=10, trust_env=False)
    assert response.status_code == 403, (path, response.status_code, response.text)
    assert "fastsched" not in response.headers.get("server", "")


def test_haproxy_passes_the_public_api(balancer: Balancer) -> None:
    models = httpx.get(balancer.url + "/v1/models", timeout=10, trust_env=False)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    for path in ("/health", "/ping", "/version"):
        assert httpx.get(balancer.url + path, timeout=10, trust_env=False).status_code == 200, path
    tokens = httpx.post(
        balancer.url + "/tokenize", json={"model": MODEL, "prompt": "a b"}, timeout=10, trust_env=False
    )
    assert tokens.status_code == 200, tokens.text
    # The replica itself still answers /metrics: the 403 above came from HAProxy.
    assert httpx.get(balancer.replicas[1].url + "/metrics", timeout=10, trust_env=False).status_code == 200


def test_haproxy_sigkilled_replica_leaves_the_rotation_without_failed_requests(balancer: Balancer) -> None:
    dead = balancer.replicas[0]
    dead.kill_all()
    killed = time.monotonic()
    statuses = []
    while time.monotonic() - killed < DOWN_WITHIN_S + 2:
        statuses.append(
            httpx.post(
                balancer.url + "/v1/completions", json=_body(4), timeout=30, trust_env=False
            ).status_code
        )
    assert statuses == [200] * len(statuses), statuses  # conn-failure: retried on the survivor
    assert wait_for(
        lambda: balancer.stats()["fastsched/replica1"]["status"].startswith("DOWN"), timeout=DOWN_WITHIN_S
    ), balancer.stats()["fastsched/replica1"]
    assert balancer.stats()["fastsched/replica2"]["status"] == "UP"
