"""``python/fastsched/_core.pyi`` describes the compiled binding truthfully: mypy's
stubtest imports ``fastsched._core`` and compares every class, method, signature and
default with the stub, so a binding change that the stub does not follow fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_core_stub_matches_the_compiled_binding(tmp_path: Path):
    # Run outside the checkout so stubtest reads the stub beside the installed package.
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "fastsched._core", "--mypy-config-file", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
