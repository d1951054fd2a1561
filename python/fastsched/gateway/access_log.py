"""The gateway's access log (uvicorn's ``uvicorn.access`` logger): one line per HTTP
request, except for the probes a load balancer or Prometheus sends every few seconds
(``/health``, ``/ping``, ``/metrics``), which would drown the requests that matter. They
are logged when that logger is at DEBUG (``--uvicorn-log-level debug``)."""

from __future__ import annotations

import logging

PROBE_PATHS = frozenset({"/health", "/ping", "/metrics"})
ACCESS_LOGGER = "uvicorn.access"


class ProbeFilter(logging.Filter):
    """Drops uvicorn's access lines of probe paths unless the access logger is at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn logs '%s - "%s %s HTTP/%s" %d' with (client, method, path?query, version, status).
        if not isinstance(args, tuple) or len(args) < 3 or not isinstance(args[2], str):
            return True
        if args[2].partition("?")[0] not in PROBE_PATHS:
            return True
        return logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.DEBUG)


def quiet_probes() -> None:
    """Installs :class:`ProbeFilter` on uvicorn's access logger (once)."""
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, ProbeFilter) for f in access.filters):
        access.addFilter(ProbeFilter())
