"""What ``fastsched serve`` takes (:class:`ServeConfig`), validated in one place before any
process starts, and the error the launcher raises when the server cannot start or a child dies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastsched.admin import AdminSettings
from fastsched.frontend.settings import FrontendSettings


class ServeError(RuntimeError):
    """The server could not start (a child failed, a port is taken) or a child died."""


@dataclass
class ServeConfig:
    """What ``fastsched serve`` takes; validated here, before anything starts."""

    engine_config: dict[str, Any] = field(default_factory=dict)  # EngineConfig keyword arguments
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051  # frontend k listens on grpc_port + k; 0: free ports, picked at start
    data_parallel_size: int = 1
    api_server_count: int = 1
    # Admission, request limits, timeouts, request logging: the frontends' settings, validated there.
    frontend: FrontendSettings = field(default_factory=FrontendSettings)
    max_engine_restarts: int = 3  # with frontend.fault_tolerance, per engine over the server's life
    allowed_origins: tuple[str, ...] = ()  # pages that may open a /v1/sessions WebSocket besides our own
    admin: AdminSettings = field(default_factory=AdminSettings)  # admin routes, their key, allowed paths
    api_key: str | None = None
    shutdown_timeout: float = 5.0  # seconds the gateway lets requests in flight finish at shutdown
    served_model_name: list[str] | None = None  # clients may send any; the first is reported
    chat_template: str | None = None  # --chat-template's text; None: the checkpoint's
    torch_num_threads: int | None = None
    access_log: bool = True
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens in responses
    responses_store_size: int = 0  # /v1/responses answers kept for GET and previous_response_id (0: none)
    log_level: str = "INFO"
    uvicorn_log_level: str | None = None  # uvicorn's loggers (None: log_level's); debug logs the probes too
    tool_call_parser: str | None = (
        None  # tool_choice "auto" (gateway.tool_parsers): --enable-auto-tool-choice
    )

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "api_server_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.torch_num_threads is not None and self.torch_num_threads < 1:
            raise ValueError(f"torch_num_threads must be a positive integer, got {self.torch_num_threads}")
        if self.frontend.num_frontends != self.api_server_count:
            raise ValueError(
                f"frontend.num_frontends ({self.frontend.num_frontends}) must equal api_server_count "
                f"({self.api_server_count})"
            )
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be non-negative, got {self.responses_store_size}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")
        if self.max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be non-negative, got {self.max_engine_restarts}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        self.admin.check_keys(self.api_key)
        if self.tool_call_parser is not None:
            from fastsched.gateway.tool_parsers import get_parser

            get_parser(self.tool_call_parser)  # a ValueError listing the known names
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.grpc_port != 0 and not 1 <= self.grpc_port <= 65535 - (self.api_server_count - 1):
            raise ValueError(
                f"grpc_port + api_server_count - 1 must be in 1..65535, got grpc_port {self.grpc_port}"
            )
        if self.host == self.grpc_host and self.grpc_port != 0 and self.port in self.grpc_ports:
            raise ValueError(f"port ({self.port}) collides with the gRPC ports {self.grpc_ports}")

    @property
    def grpc_ports(self) -> list[int]:
        """The frontends' ports as configured (all 0 with ``grpc_port`` 0: the launcher picks)."""
        if self.grpc_port == 0:
            return [0] * self.api_server_count
        return [self.grpc_port + k for k in range(self.api_server_count)]
