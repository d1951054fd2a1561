"""The package's architecture, checked from its imports (read from the code, nothing run):
one package per process, no import cycles, no module importing a higher layer, and
frontend and gateway processes that never load torch (docs/architecture.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "fastsched"

# Lowest first. A module may import its own layer and those below it. The root package
# (``fastsched/__init__.py``) is above everything: it only loads the offline API lazily.
LAYERS = [
    (
        "_core",
        "sampling_params",
        "limits",
        "outputs",
        "proto_gen",
        "rpc",
        "admin",
        "units",
        "structured",
        "process_stats",
        "json_flags",
        "speculative_config",
        "kv_transfer",
        "config",
        "cpu_env",
    ),
    ("kernels", "sample", "distributed"),
    ("attention",),
    ("models", "lora"),
    ("model_loader",),
    ("spec_decode",),
    ("worker",),
    ("engine", "inputs", "request_gate"),
    ("frontend",),
    ("gateway",),
    ("launcher",),
    ("tools",),
    ("entrypoints", "__main__"),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        if "_proto" in path.parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts).removesuffix(".__init__")] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (lazy imports inside functions included).
    ``fastsched._core`` (the compiled extension) counts as a module of its own."""
    files = module_files()
    known = set(files) | {"fastsched._core"}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parents + ([base] if base else []))
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        deps = set()
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module and target.startswith("fastsched"):
                deps.add(target)
        graph[module] = deps
    return graph


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)  # the root package
    if parts[1] not in RANK:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS in {__file__}")
    return RANK[parts[1]]


def test_every_module_belongs_to_a_layer():
    for module in module_files():
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{module} -> {dep}"
        for module, deps in import_graph().items()
        for dep in deps
        if layer_of(dep) > layer_of(module)
    ]
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "package",
    [
        "fastsched.frontend",
        "fastsched.gateway",
        "fastsched.engine.protocol",
        "fastsched.config",
        "fastsched.entrypoints.cli",
    ],
)
def test_process_packages_do_not_import_torch(package: str):
    """A frontend or gateway process never runs the model; neither do flag parsing and the
    wire types. Every module of ``package`` is imported in a fresh interpreter."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"root = importlib.import_module({package!r})\n"
        "for m in pkgutil.walk_packages(getattr(root, '__path__', []), root.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {package} loads torch: {out.stdout.strip()}"


@pytest.mark.parametrize("module", ["fastsched.entrypoints.cli", "fastsched.launcher.serve"])
def test_what_a_spawned_child_imports_before_blocking_sigint_starts_no_thread(module: str):
    """A spawned frontend or engine re-imports the CLI (the parent's ``__main__``) and the module of
    its target before it blocks SIGINT (``frontend.process.block_sigint``); a native thread started
    then (numpy's BLAS pool, tokenizers') would take Ctrl-C, meant for the launcher alone, and kill
    the child out of the shutdown order."""
    code = f"import os, {module}\nprint(len(os.listdir('/proc/self/task')))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1", f"importing {module} starts {int(out.stdout) - 1} thread(s)"
