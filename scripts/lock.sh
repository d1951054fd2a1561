#!/usr/bin/env bash
# Regenerates the pinned lock files from pyproject.toml (its dependencies and extras are the
# one source): requirements-serve.txt (what `scripts/run.sh` installs: the package's base and
# `serve` dependencies) and requirements-test.txt (what `scripts/test.sh` installs: `test`,
# which includes `serve` and `bench`, held to the serve lock's versions). Versions already
# pinned are kept unless you pass --upgrade or --upgrade-package NAME (uv pip compile's flags).
# Linux x86_64, CPython 3.11 (the CI machine's and the image's platform).
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${UV:-}
if [ -z "$uv" ]; then
    if [ -x .venv/bin/uv ]; then uv=.venv/bin/uv; else uv=$(command -v uv || true); fi
fi
[ -n "$uv" ] || { echo "lock: uv not found (it is in the test extra: scripts/test.sh installs it)" >&2; exit 1; }
common=(--quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header --annotation-style line)
"$uv" pip compile "${common[@]}" "$@" pyproject.toml --extra serve -o requirements-serve.txt
"$uv" pip compile "${common[@]}" "$@" pyproject.toml --extra test -c requirements-serve.txt -o requirements-test.txt
echo "lock: wrote requirements-serve.txt and requirements-test.txt"
