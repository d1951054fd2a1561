#!/usr/bin/env bash
# Installs what fastsched needs into ./.venv and builds the Rust extension.
#   scripts/setup.sh serve   the package and its `serve` extra (requirements-serve.txt: scripts/run.sh)
#   scripts/setup.sh [test]  everything the tests need (requirements-test.txt: scripts/test.sh)
# Both add the embedded model (requirements-nodeps.txt). The lock files are generated from
# pyproject.toml by scripts/lock.sh. Idempotent: a second run only re-checks (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-test}
case "$mode" in
    serve) lock=requirements-serve.txt ;;
    test) lock=requirements-test.txt ;;
    *) echo "setup: unknown mode '$mode' (serve or test)" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $python"
    "$python" -m venv .venv
fi

# Python dependencies: reinstalled only when a lock file changes. The test lock holds the
# serve lock's versions, so a venv set up for the tests also satisfies `serve`.
stamp=.venv/.fastsched-requirements
hash=$(cat requirements-serve.txt requirements-test.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
have=$(cat "$stamp" 2>/dev/null || true)
if [ "$have" != "$mode $hash" ] && [ "$have" != "test $hash" ]; then
    echo "setup: installing Python dependencies ($lock, requirements-nodeps.txt)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r "$lock"
    .venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt
    echo "$mode $hash" > "$stamp"
fi

# The Rust extension fastsched._core (cargo rebuilds only what changed). maturin, its
# builder, is in the test lock; a serve-only venv gets it here.
[ -x .venv/bin/maturin ] || .venv/bin/python -m pip install -q "$(grep -o '^maturin==[^ ]*' requirements-test.txt)"
src_hash=$(find rust Cargo.toml Cargo.lock pyproject.toml -type f \( -name '*.rs' -o -name '*.toml' -o -name '*.lock' \) -print0 \
    | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
ext_stamp=.venv/.fastsched-extension
if [ "$(cat "$ext_stamp" 2>/dev/null)" != "$src_hash" ] || ! .venv/bin/python -c "import fastsched._core" 2>/dev/null; then
    echo "setup: building fastsched._core (release)"
    .venv/bin/maturin develop --release -q
    echo "$src_hash" > "$ext_stamp"
fi
