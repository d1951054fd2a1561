#!/usr/bin/env bash
# Installs the test lock (the server, the oracles, the tools), then runs every test: the Rust core's unit and
# property tests and the CPU kernels' tests, then the Python suite (binding, conformance, engine).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
echo "== cargo test (fastsched-core, fastsched-kernels)"
cargo test --release -p fastsched-core -p fastsched-kernels
echo "== pytest"
.venv/bin/python -m pytest "$@"
