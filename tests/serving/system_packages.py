"""Debian tools some tests need (HAProxy, Prometheus's promtool): found on PATH, else
installed with apt-get when the test runs as root on a Debian-like machine (CI's fresh
machines), else the test is skipped with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

_APT_TIMEOUT_S = 600


def require(binary: str, package: str) -> str:
    """The path of ``binary``, installing Debian ``package`` first if it is missing."""
    path = shutil.which(binary)
    if path is not None:
        return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(
            f"{binary} is not installed and cannot be installed here (needs root and apt-get): "
            f"apt-get install {package}"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (
        ["apt-get", "install", "-y", "-qq", package],
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", package],
    ):
        subprocess.run(command, env=env, capture_output=True, timeout=_APT_TIMEOUT_S)
        if (path := shutil.which(binary)) is not None:
            return path
    pytest.skip(
        f"{binary} could not be installed with `apt-get install {package}` (no network or no such package)"
    )
