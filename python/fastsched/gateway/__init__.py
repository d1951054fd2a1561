"""The gateway process: the OpenAI-compatible HTTP API (Starlette on uvicorn) in
front of the gRPC frontends, and the Prometheus exposition of their metrics."""
