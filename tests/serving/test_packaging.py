"""pyproject.toml is the one honest source of dependencies (issue 25 item 1): every third-party
import under python/fastsched is provided by the base install or by the extra that needs it,
nothing declared goes unused, the lock files hold what pyproject.toml asks for, and the base
install alone runs ``fastsched.LLM`` (the serve install alone imports the server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging_deps import (
    PACKAGE,
    REPO,
    blocker_source,
    canonical,
    closure,
    declared,
    module_owners,
    third_party_imports,
)

# Imported although no extra declares it: an accelerator library a user installs for their
# CUDA version; every import of it is guarded (fastsched runs without it).
UNDECLARED_OPTIONAL = {"flashinfer": "installed by the user"}
# Imported through a declared dependency's own requirement: torch requires triton (its GPU
# kernel compiler) on Linux x86_64, and fastsched's Triton kernels run only on such GPUs.
TRANSITIVE = {"triton": "torch"}
# Declared but loaded by name rather than imported: uvicorn picks its HTTP parser and its
# WebSocket implementation by module name (--http httptools, --ws websockets).
LOADED_BY_NAME = {"httptools", "websockets"}
USER_EXTRAS = ("serve", "bench", "ray")
# Developer commands whose imports come from the `test` extra (python -m fastsched.proto_gen: grpcio-tools).
DEV_MODULES = {"proto_gen.py"}


def _declared_names(extra: str | None) -> set[str]:
    return {canonical(r.name) for r in declared(extra)} - {"fastsched"}


def _lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            dist, _, version = line.partition("==")
            assert version, f"{name}: {line!r} is not pinned with =="
            pins[canonical(dist)] = version.strip()
    return pins


def test_every_third_party_import_is_declared_by_the_base_install_or_an_extra() -> None:
    owners = module_owners()
    provided = set().union(*(_declared_names(extra) for extra in (None, *USER_EXTRAS)))
    dev = _declared_names("test")
    missing = {}
    for module, files in third_party_imports().items():
        if module in UNDECLARED_OPTIONAL:
            continue
        if module in TRANSITIVE:
            assert TRANSITIVE[module] in _declared_names(None) and canonical(module) in closure([]), module
            continue
        dists = owners.get(module)
        assert dists, f"{module} (imported by {sorted(files)}) is installed by no distribution in this venv"
        if not dists & provided and not (files <= DEV_MODULES and dists & dev):
            missing[module] = sorted(files)
    assert not missing, f"imported but declared by no extra of pyproject.toml: {missing}"


def test_undeclared_optional_imports_are_guarded() -> None:
    for module, files in third_party_imports().items():
        if module not in UNDECLARED_OPTIONAL:
            continue
        for rel in files:
            text = (PACKAGE / rel).read_text()
            assert "except ImportError" in text, (
                f"{rel} imports {module} ({UNDECLARED_OPTIONAL[module]}) unguarded"
            )


@pytest.mark.parametrize("extra", [None, *USER_EXTRAS])
def test_every_declared_dependency_is_imported(extra: str | None) -> None:
    owners = module_owners()
    imported = set().union(*(owners.get(module, set()) for module in third_party_imports()))
    unused = _declared_names(extra) - imported - LOADED_BY_NAME
    where = extra or "the base install"
    assert not unused, f"declared in {where} but imported nowhere under python/fastsched: {unused}"


def test_lock_files_pin_what_pyproject_declares() -> None:
    serve, test = _lock("requirements-serve.txt"), _lock("requirements-test.txt")
    for lock, extras in ((serve, [None, "serve"]), (test, [None, "serve", "bench", "test"])):
        for extra in extras:
            for req in declared(extra):
                if canonical(req.name) == "fastsched":
                    continue
                name = canonical(req.name)
                assert name in lock, (
                    f"{req} ({extra or 'base'}) is missing from its lock file; run scripts/lock.sh"
                )
                assert req.specifier.contains(lock[name], prereleases=True), (
                    f"the lock pins {name}=={lock[name]}, outside {req}; run scripts/lock.sh"
                )
    # The test lock is generated with the serve lock as constraints: one version of each package.
    assert {name: test[name] for name in serve} == serve
    assert not set(test) & _lock("requirements-nodeps.txt").keys()
    # The test tools and oracles stay out of what scripts/run.sh installs.
    assert (
        not {
            "pytest",
            "transformers",
            "accelerate",
            "peft",
            "openai",
            "mypy",
            "hypothesis",
            "kubernetes-validate",
            "jsonschema",
            "grpcio-tools",
        }
        & serve.keys()
    )


def test_scripts_install_their_own_lock() -> None:
    assert "scripts/setup.sh serve" in (REPO / "scripts" / "run.sh").read_text()
    assert "scripts/setup.sh test" in (REPO / "scripts" / "test.sh").read_text()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "serve) lock=requirements-serve.txt" in setup and "test) lock=requirements-test.txt" in setup


def _run_hidden(allowed: set[str], code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(blocker_source(allowed) + code)
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )


def test_the_base_install_alone_runs_llm(tmp_path: Path) -> None:
    """Only the base dependencies' closure is importable: no server, no test oracle."""
    from fastsched.tools.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", seed=0)
    code = f"""
from fastsched import LLM, SamplingParams
llm = LLM(model={str(model)!r}, device="cpu", dtype="float32", num_gpu_blocks=32, max_model_len=64)
out = llm.generate(["a b"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 3, out
import fastsched.entrypoints.cli  # `fastsched generate` is in the base install too
import sys
loaded = {{m.split(".")[0] for m, v in sys.modules.items() if v is not None}}
leaked = sorted(loaded & {{"grpc", "zmq", "starlette", "uvicorn", "transformers"}})
assert not leaked, leaked
print("ok")
"""
    out = _run_hidden(closure([]), code, tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_the_serve_install_alone_imports_the_server(tmp_path: Path) -> None:
    code = """
import importlib
for name in ("fastsched.entrypoints.cli", "fastsched.launcher.serve", "fastsched.gateway.app",
             "fastsched.gateway.sessions", "fastsched.frontend.grpc_server", "fastsched.engine.engine_proc",
             "fastsched.tools.top_screen"):
    importlib.import_module(name)
import sys
loaded = {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
leaked = sorted(loaded & {"pytest", "transformers", "openai", "grpc_tools"})
assert not leaked, leaked
print("ok")
"""
    out = _run_hidden(closure(["serve"]), code, tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_the_blocker_hides_what_is_outside_the_install(tmp_path: Path) -> None:
    """The two tests above could not fail if the blocker hid nothing."""
    out = _run_hidden(closure([]), "import grpc\n", tmp_path)
    assert out.returncode != 0 and "ModuleNotFoundError: import of grpc halted" in out.stderr
    assert Requirement("grpcio>=1").name == "grpcio"
