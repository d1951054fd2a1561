"""S13 through ``fastsched serve``: a reload of a checkpoint that cannot be loaded (here a
truncated ``model.safetensors``, which raises ``SafetensorError``) answers 400 with the
cause, the old weights go on serving and the server keeps running: with one rank, with two
tensor-parallel ranks, and under ``--enable-fault-tolerance`` (no engine restarted either).
"""

from __future__ import annotations

from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from serve_process import start_serve  # noqa: E402

ADMIN = {"Authorization": "Bearer sk-admin"}
PROMPT = [5, 77, 300, 12, 9, 41]


def _complete(url: str) -> str:
    r = httpx.post(
        url + "/v1/completions",
        timeout=120,
        trust_env=False,
        json={"model": "model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _truncated_copy(model_dir: Path, out: Path) -> Path:
    out.mkdir()
    for file in model_dir.iterdir():
        if file.is_file():
            data = file.read_bytes()
            cut = data[: len(data) // 2] if file.name == "model.safetensors" else data
            (out / file.name).write_bytes(cut)
    return out


@pytest.mark.parametrize(
    "flags",
    [(), ("--enable-fault-tolerance",), ("--tensor-parallel-size", "2")],
    ids=["tp1", "fault-tolerance", "tp2"],
)
def test_s13_a_truncated_checkpoint_is_400_and_the_old_weights_serve_on(
    tiny_model_dir: Path, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    bad = _truncated_copy(tiny_model_dir, allowed / "truncated")
    server = start_serve(
        tiny_model_dir,
        tmp_path / "serve.log",
        "--enable-admin-api",
        "--admin-api-key",
        "sk-admin",
        "--allowed-local-paths",
        str(allowed),
        *flags,
    )
    try:
        before = _complete(server.url)
        engines = server.engine_pids
        assert httpx.post(server.url + "/pause?mode=all", headers=ADMIN, timeout=30).status_code == 200
        r = httpx.post(server.url + "/reload_weights", headers=ADMIN, timeout=120, json={"path": str(bad)})
        assert r.status_code == 400, r.text
        assert "SafetensorError" in r.json()["error"]["message"] and "the served ones stay" in r.text
        assert httpx.post(server.url + "/resume", headers=ADMIN, timeout=30).status_code == 200
        assert _complete(server.url) == before, "the old weights serve"
        assert server.proc.poll() is None and server.engine_pids == engines, "no engine died or restarted"
    finally:
        server.close()
