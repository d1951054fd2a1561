"""The gateway's access log keeps one line per request but leaves out the probes a load
balancer or Prometheus sends every few seconds, unless uvicorn logs at DEBUG
(``--uvicorn-log-level debug``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from fastsched.gateway.access_log import ACCESS_LOGGER, ProbeFilter, quiet_probes


def access_record(path: str) -> logging.LogRecord:
    """A record as uvicorn's access logger makes it."""
    return logging.LogRecord(
        ACCESS_LOGGER,
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", path, "1.1", 200),
        None,
    )


@pytest.fixture
def access_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger(ACCESS_LOGGER)
    level, filters = logger.level, list(logger.filters)
    yield logger
    logger.setLevel(level)
    logger.filters[:] = filters


@pytest.mark.parametrize("path", ["/health", "/metrics", "/ping", "/health?verbose=1"])
def test_probes_are_not_access_logged_unless_uvicorn_logs_at_debug(
    access_logger: logging.Logger, path: str
) -> None:
    access_logger.setLevel(logging.INFO)
    assert not ProbeFilter().filter(access_record(path))
    access_logger.setLevel(logging.DEBUG)
    assert ProbeFilter().filter(access_record(path))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/healthz", "/v1/models"])
def test_every_other_request_is_access_logged(access_logger: logging.Logger, path: str) -> None:
    access_logger.setLevel(logging.INFO)
    assert ProbeFilter().filter(access_record(path))


def test_the_filter_is_installed_once(access_logger: logging.Logger) -> None:
    quiet_probes()
    quiet_probes()
    assert sum(isinstance(f, ProbeFilter) for f in access_logger.filters) == 1
