#!/usr/bin/env bash
# Installs the test lock (the server, the oracles, the tools), then runs every test: the Rust core's unit and
# property tests, then the Python suite (binding, conformance, engine).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
echo "== cargo test (fastsched-core)"
cargo test --release -p fastsched-core
echo "== pytest"
.venv/bin/python -m pytest "$@"
