"""``fastsched serve``: starts and supervises the engine, frontend and gateway
processes and shuts them down together."""
