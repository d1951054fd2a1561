#!/usr/bin/env bash
# Installs everything, then runs fastsched's main job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/fastsched generate "$@"
