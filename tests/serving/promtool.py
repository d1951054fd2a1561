"""``promtool check metrics`` for the tests: Prometheus' own parser and linter over a
``/metrics`` page.

promtool comes with Debian's ``prometheus`` package; when it is missing it is installed
with apt-get (as root), and a test that needs it is skipped, saying why, only when that
is impossible.

Two of promtool's lint rules are broken on purpose, by vLLM's names, which ours follow
(prefix ``fastsched:`` for ``vllm:``, the same suffixes) so that a vLLM dashboard works
unchanged: a colon in every name (Prometheus reserves it for recording rules; vLLM uses
it), and ``iteration_tokens_total``, a histogram whose name ends in ``_total``. Every
other problem fails the check.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ACCEPTED_LINT = ("metric names should not contain ':'",)
ACCEPTED_LINT_OF = {
    "fastsched:iteration_tokens_total": 'non-counter metrics should not have "_total" suffix',
}


def promtool() -> str:
    """The promtool binary; installs Debian's ``prometheus`` package when it is missing."""
    path = shutil.which("promtool")
    if path is not None:
        return path
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(
            "promtool is missing and cannot be installed here (needs root and apt-get: "
            "`apt-get install prometheus`)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
    ):
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"promtool is missing and `{' '.join(command)}` failed: {done.stderr.strip()[-500:]}")
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("the prometheus package installed no promtool")
    return path


def lint_problems(text: str) -> list[str]:
    """promtool's problems with the page that vLLM's names do not explain; fails the test
    when promtool cannot parse the page at all."""
    done = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    # 0: clean; 3: lint problems only; anything else: the page could not be read.
    assert done.returncode in (0, 3), f"promtool check metrics failed ({done.returncode}): {done.stderr}"
    problems = []
    for line in (done.stdout + done.stderr).splitlines():
        name, _, problem = line.partition(" ")
        if not line.strip() or problem in ACCEPTED_LINT or ACCEPTED_LINT_OF.get(name) == problem:
            continue
        problems.append(line)
    return problems
