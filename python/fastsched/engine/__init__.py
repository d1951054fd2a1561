"""The engine process: EngineCore (schedule, execute, update) around the Rust
scheduler and the model runner, its ZMQ loop, and the torch-free wire types the
frontends speak (``protocol``)."""
