#!/usr/bin/env bash
# Installs everything fastsched needs into ./.venv and builds the Rust
# extension. Idempotent: a second run only re-checks (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $python"
    "$python" -m venv .venv
fi

# Python dependencies: reinstalled only when a requirements file changes.
reqs=(requirements.txt)
for extra in requirements-engine.txt requirements-serve.txt; do
    [ -f "$extra" ] && reqs+=("$extra")
done
nodeps=()
[ -f requirements-nodeps.txt ] && nodeps=(requirements-nodeps.txt)
stamp=.venv/.fastsched-requirements
want=$(cat "${reqs[@]}" "${nodeps[@]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing Python dependencies (${reqs[*]} ${nodeps[*]})"
    .venv/bin/python -m pip install -q --upgrade pip
    args=()
    for r in "${reqs[@]}"; do args+=(-r "$r"); done
    .venv/bin/python -m pip install -q "${args[@]}"
    for r in "${nodeps[@]}"; do .venv/bin/python -m pip install -q --no-deps -r "$r"; done
    echo "$want" > "$stamp"
fi

# The Rust extension fastsched._core (cargo rebuilds only what changed).
src_hash=$(find rust Cargo.toml Cargo.lock pyproject.toml -type f \( -name '*.rs' -o -name '*.toml' -o -name '*.lock' \) -print0 \
    | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
ext_stamp=.venv/.fastsched-extension
if [ "$(cat "$ext_stamp" 2>/dev/null)" != "$src_hash" ] || ! .venv/bin/python -c "import fastsched._core" 2>/dev/null; then
    echo "setup: building fastsched._core (release)"
    .venv/bin/maturin develop --release -q
    echo "$src_hash" > "$ext_stamp"
fi
