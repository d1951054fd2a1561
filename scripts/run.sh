#!/usr/bin/env bash
# Installs the server (the serve lock), then serves the model (default: the embedded SmolLM2-135M-Instruct)
# on http://127.0.0.1:8000 (OpenAI API) with gRPC frontends on 127.0.0.1:50051.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh serve
exec .venv/bin/fastsched serve "$@"
