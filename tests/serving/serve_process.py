"""The real ``fastsched serve`` as a subprocess, for process-level tests and the bench
smoke test: start it on free ports, wait for ``/health``, read its log, stop it.

The launcher runs in a session of its own, so teardown can SIGKILL the whole process
group (launcher, engines, frontends) whatever state a failed test left it in. Its
output goes to a file (a pipe nobody reads would fill and block the server); the log
lines the launcher documents (``fastsched.launcher.serve``) tell the children's pids,
the ipc directory and the shared-memory segment.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import fastsched

KV_CACHE_MEMORY = 8 * 1024 * 1024  # ~1000 blocks of 16 tokens on the tiny model
START_TIMEOUT_S = 120.0


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> int:
    """A base port with ``count`` consecutive free ports (best effort, as free_port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count <= 65535 and all(_port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    grpc_ports: list[int] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _find(self, pattern: str) -> list[tuple[str, ...]]:
        return re.findall(pattern, self.log())

    @property
    def engine_pids(self) -> list[int]:
        return [int(pid) for _, pid in sorted(self._find(r"engine (\d+) ready \(pid (\d+)\)"))]

    @property
    def frontend_pids(self) -> list[int]:
        return [
            int(pid) for _, pid in sorted(self._find(r"frontend (\d+) serving gRPC on \S+ \(pid (\d+)\)"))
        ]

    @property
    def child_pids(self) -> list[int]:
        """Every engine and frontend the launcher started, ready or not."""
        return [int(pid) for _, _, pid in self._find(r"(engine|frontend) (\d+) starting \(pid (\d+)\)")]

    @property
    def ipc_dir(self) -> Path:
        return Path(self._find(r"ipc dir (\S+); shared admission stats")[0])

    @property
    def shm_path(self) -> Path:
        return Path(self._find(r"shared admission stats (\S+)")[0])

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to the launcher only; its exit code, None if it did not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill_all(self) -> None:
        """SIGKILL to the launcher's whole process group (stray children included)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def close(self) -> None:
        """Teardown: terminate, then kill whatever is left. Never raises."""
        try:
            self.terminate()
        finally:
            self.kill_all()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])


def serve_command(
    model_dir: Path, port: int, grpc_port: int, *args: str, max_model_len: int = 256
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fastsched.entrypoints.cli",
        "serve",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(KV_CACHE_MEMORY),
        "--max-model-len",
        str(max_model_len),
        "--torch-num-threads",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        *args,
    ]


def serve_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    package_root = str(Path(fastsched.__file__).resolve().parents[1])  # works from a bare checkout too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def launch(
    model_dir: Path,
    log_path: Path,
    *args: str,
    api_server_count: int = 1,
    max_model_len: int = 256,
    env: dict[str, str] | None = None,
) -> ServeProcess:
    """Starts ``fastsched serve`` without waiting for it; ``env``: extra environment variables."""
    port = free_ports(1)
    grpc_port = free_ports(api_server_count)
    cmd = serve_command(
        model_dir,
        port,
        grpc_port,
        "--api-server-count",
        str(api_server_count),
        *args,
        max_model_len=max_model_len,
    )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**serve_env(), **(env or {})},
            start_new_session=True,
        )
    return ServeProcess(
        proc, f"http://127.0.0.1:{port}", log_path, [grpc_port + k for k in range(api_server_count)]
    )


def start_serve(
    model_dir: Path,
    log_path: Path,
    *args: str,
    api_server_count: int = 1,
    max_model_len: int = 256,
    env: dict[str, str] | None = None,
) -> ServeProcess:
    """Starts ``fastsched serve`` and waits until ``/health`` answers 200."""
    server = launch(
        model_dir, log_path, *args, api_server_count=api_server_count, max_model_len=max_model_len, env=env
    )
    wait_healthy(server)
    return server


def wait_healthy(server: ServeProcess) -> None:
    """Waits until a launched server's ``/health`` answers 200; closes it and raises if it
    exits or is not healthy within START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"fastsched serve exited with {server.proc.returncode}:\n{server.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"fastsched serve not healthy after {START_TIMEOUT_S:g} s:\n{server.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                healthy = httpx.get(server.url + "/health", timeout=2, trust_env=False).status_code == 200
                # The launcher logs "gateway listening" once uvicorn has started; /health may answer first.
                if healthy and "gateway listening on" in server.log():
                    return
            time.sleep(0.1)
    except BaseException:
        server.close()
        raise


def metric_samples(url: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}``, without the labels ``model_name`` and
    ``engine``: the series of all engines are summed (``fastsched:num_requests_running``,
    ``fastsched:admission_rejections_total{reason="ttft_slo"}``)."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = (
                re.sub(r'(?<=[{,])(model_name|engine)="[^"]*",?', "", name)
                .replace(",}", "}")
                .replace("{}", "")
            )
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples
