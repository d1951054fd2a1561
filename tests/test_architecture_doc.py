"""docs/architecture.md names the code of each hop; every name it cites in backticks must exist.

What is checked, per backticked span:

- a path (``gateway/app.py``, ``rust/fastsched-core/src/output.rs``, ``kv_connector/``): the file or
  folder exists, under ``python/fastsched/`` or the repository root (or as a Rust module name);
- ``path::Name`` or ``path::Name.member``: the path exists and defines ``Name`` (and ``member`` in it);
- ``Class.member`` (a capitalised first part): some module defines the class, and one of the
  files that define it defines or assigns ``member``;
- a private name (``_finish``, ``_Request``): it is defined somewhere (def, class, fn, or assigned);
- any other identifier or dotted name: each part occurs as a word in the code.

Spans that are not code names (flags, literals, JSON, wire arrays, expressions) are skipped.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "python" / "fastsched"

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"{_IDENT}(?:(?:\.|::){_IDENT})*(?:\(\))?")
_PATH = re.compile(r"[\w./{},-]+/[\w./{},-]*|[\w-]+\.(?:py|rs|pyi|proto|sh|md)(?:::[\w.]+)?")


@functools.cache
def _sources() -> dict[Path, str]:
    files = [
        *PACKAGE.rglob("*.py"),
        *PACKAGE.rglob("*.pyi"),
        *(ROOT / "rust").rglob("*.rs"),
        *(ROOT / "proto").rglob("*.proto"),
    ]
    return {f: f.read_text(encoding="utf-8") for f in files if "target" not in f.parts}


@functools.cache
def _words() -> frozenset[str]:
    return frozenset(w for text in _sources().values() for w in re.findall(_IDENT, text))


# Where a name is defined: def/class/fn/struct/..., an assignment or annotation (module, class or
# self attribute), a Rust impl, an enum variant or struct field on a line of its own.
_DEFINITION = re.compile(
    rf"^\s*(?:async\s+def|def|class|(?:pub(?:\([a-z]+\))?\s+)?(?:fn|struct|enum|trait|type|const|static|mod|message|rpc|service))"
    rf"\s+({_IDENT})|^\s*(?:self\.)?({_IDENT})\s*(?::[^=\n]*)?=[^=]|^\s*(?:pub\s+)?({_IDENT})\s*:|"
    rf"\bself\.({_IDENT})\s*(?::[^=\n]*)?=[^=]|\bimpl(?:<[^>]*>)?\s+(?:{_IDENT}\s+for\s+)?({_IDENT})|"
    rf"^\s*({_IDENT})\s*(?:[,(]|\{{)|^\s*(?:{_IDENT}\s*,\s*)+({_IDENT})\s*=",
    re.MULTILINE,
)


@functools.cache
def _definitions(path: Path) -> frozenset[str]:
    return frozenset(name for groups in _DEFINITION.findall(_sources()[path]) for name in groups if name)


def _defines(path: Path, name: str) -> bool:
    return name in _definitions(path)


@functools.cache
def _defined_anywhere(name: str) -> tuple[Path, ...]:
    return tuple(f for f in _sources() if _defines(f, name))


@functools.cache
def _repo_names() -> frozenset[str]:
    """Every file and folder name in the repository (a table cell names a file by its name alone)."""
    names = set()
    for base in ("python", "rust", "bench", "tests", "proto", "docs", "scripts", "deploy"):
        for f in (ROOT / base).rglob("*"):
            if "target" not in f.parts and "__pycache__" not in f.parts:
                names.add(f.name)
    return frozenset(names)


def _resolve_path(path: str) -> Path | None:
    path = path.rstrip("/")
    for base in (PACKAGE, ROOT, PACKAGE.parent):
        if (base / path).exists():
            return base / path
    return None


def _check_path(span: str) -> str | None:
    path, _, member = span.partition("::")
    if "{" in path:  # kv/{block_pool,prefix_cache}: each one
        head, _, rest = path.partition("{")
        names, _, tail = rest.partition("}")
        missing = [
            n
            for n in names.split(",")
            if _resolve_path(f"{head}{n}{tail}") is None and not {n, f"{n}.rs", f"{n}.py"} & _repo_names()
        ]
        return f"{span}: no {', '.join(missing)}" if missing else None
    if "…" in path or path.startswith(("http", "<", "/")):  # an elision, a URL, an HTTP route
        return None
    found = _resolve_path(path)
    if found is None:
        if "/" not in path.rstrip("/") and path.rstrip("/") in _repo_names():
            return None
        return f"{span}: no such file or folder"
    if member:
        if found not in _sources():
            return f"{span}: {found.relative_to(ROOT)} is not a source file"
        for part in re.split(r"\.|::", member):
            if not _defines(found, part):
                return f"{span}: {found.relative_to(ROOT)} does not define {part}"
    return None


def _check_name(span: str) -> str | None:
    name = span.removesuffix("()")
    parts = re.split(r"\.|::", name)
    if len(parts) >= 2 and parts[-2][:1].isupper():  # Class.member
        owner, member = parts[-2], parts[-1]
        homes = _defined_anywhere(owner)
        if not homes:
            return f"{span}: no definition of {owner}"
        if not any(_defines(f, member) for f in homes):
            return (
                f"{span}: {owner} (in {', '.join(str(f.relative_to(ROOT)) for f in homes)}) has no {member}"
            )
        return None
    for part in parts:
        if part.startswith("_") and not part.startswith("__") and not _defined_anywhere(part):
            return f"{span}: no definition of {part}"
        if part not in _words() and part not in ("self",):
            return f"{span}: {part} occurs nowhere in the code"
    return None


def cited_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def check(span: str) -> str | None:
    span = span.strip()
    if _PATH.fullmatch(span) and ("/" in span or "." in span.split("::")[0]):
        return _check_path(span)
    if _DOTTED.fullmatch(span):
        return _check_name(span)
    return None  # a flag, a literal, an expression: not a code name


def test_every_code_name_cited_in_architecture_md_exists() -> None:
    problems = [p for span in cited_spans(DOC.read_text(encoding="utf-8")) if (p := check(span)) is not None]
    assert not problems, "docs/architecture.md cites code that does not exist:\n" + "\n".join(problems)


def test_the_check_catches_a_stale_name() -> None:
    assert check("frontend/async_llm.py::AsyncLLM.generate") is None
    assert check("AsyncLLM.no_such_method") is not None
    assert check("frontend/no_such_module.py") is not None
    assert check("_no_such_private_helper") is not None
    assert check("--max-num-seqs") is None  # a flag: not a code name
