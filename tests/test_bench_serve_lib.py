"""bench/lib/serve.sh, the start/wait/stop shared by the bench scripts that start a server:
it returns once /health answers, stops the server it started, and fails naming the log when
the server exits first. A stand-in for `fastsched serve` (python's http.server over a folder
holding a `health` file) keeps it fast."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_fastsched(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fastsched"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def _run(tmp_path: Path, fake: Path, port: int, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f". bench/lib/serve.sh\n{script}"],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=60,
        env={**os.environ, "FS": str(fake)},
    )


def test_server_started_answers_and_is_stopped(tmp_path: Path) -> None:
    (tmp_path / "health").write_text("ok")
    port = _free_port()
    # A background job of a non-interactive shell starts with SIGINT ignored; `fastsched
    # serve` installs its own handler, and so does the stand-in.
    server = (
        f"import signal, http.server, functools; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), functools.partial("
        f"http.server.SimpleHTTPRequestHandler, directory='{tmp_path}')).serve_forever()"
    )
    fake = _fake_fastsched(tmp_path, f'exec {sys.executable} -c "{server}"')
    log = tmp_path / "serve.log"
    done = _run(
        tmp_path,
        fake,
        port,
        f"""
serve_start {log} {port} -- serve --port {port}
curl -sf http://127.0.0.1:{port}/health
echo " pid=$SERVER_PID"
serve_stop
kill -0 $SERVER_PID 2>/dev/null && echo still-running || echo stopped
""",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok pid=")
    assert done.stdout.rstrip().endswith("stopped")


def test_server_that_exits_fails_naming_its_log(tmp_path: Path) -> None:
    port = _free_port()
    fake = _fake_fastsched(tmp_path, "echo 'no model' >&2; exit 3")
    log = tmp_path / "serve.log"
    done = _run(tmp_path, fake, port, f"serve_start {log} {port} 20 -- serve\necho unreachable")
    assert done.returncode == 1
    assert f"server exited; see {log}" in done.stderr
    assert "unreachable" not in done.stdout
    assert log.read_text().strip() == "no model"
