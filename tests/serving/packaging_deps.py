"""What pyproject.toml declares and what python/fastsched imports, for test_packaging.py and
test_wheel_install.py: the declared requirements per extra, their transitive closure over
the installed distributions, and an import blocker that hides everything outside a closure."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "python" / "fastsched"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def declared(extra: str | None = None) -> list[Requirement]:
    """The requirements of the base install (``extra=None``) or of one extra, as written."""
    project = pyproject()["project"]
    raw = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(r) for r in raw]


def closure(extras: Iterable[str]) -> set[str]:
    """Canonical names of the installed distributions that ``fastsched[extras]`` pulls in,
    transitively (markers evaluated for this interpreter), fastsched itself excluded."""
    todo: list[tuple[Requirement, str]] = [(r, "") for r in declared()]
    for extra in extras:
        todo += [(r, extra) for r in declared(extra)]
    seen: set[str] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonical(req.name)
        if name == "fastsched":  # a self-reference: fastsched[serve,bench]
            todo += [(r, e) for e in req.extras for r in declared(e)]
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # the caller checks that what it needs is installed
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            for e in ("", *req.extras):
                if sub_req.marker is None or sub_req.marker.evaluate({"extra": e}):
                    todo.append((sub_req, e))
                    break
    return seen


def module_owners() -> dict[str, set[str]]:
    """Top-level module name -> canonical names of the installed distributions providing it."""
    return {mod: {canonical(d) for d in dists} for mod, dists in md.packages_distributions().items()}


def third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the files under python/fastsched importing it."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("fastsched", "__future__"):
                    found.setdefault(top, set()).add(str(path.relative_to(PACKAGE)))
    return found


BLOCKER = """
import sys
# None in sys.modules: `import name` raises ModuleNotFoundError and importlib.util.find_spec
# answers None, exactly as for a module that is not installed.
sys.modules.update(dict.fromkeys(%r))
"""


def blocker_source(allowed: set[str]) -> str:
    """Python source that, run first, makes every module of an installed distribution outside
    ``allowed`` (canonical names) unimportable, as if only ``allowed`` were installed."""
    blocked = {
        mod
        for mod, owners in module_owners().items()
        if not owners & allowed and mod not in sys.stdlib_module_names and mod != "fastsched"
    }
    return BLOCKER % sorted(blocked)
