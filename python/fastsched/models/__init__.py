"""Model architectures (``llama``: the Llama family) and their configuration (``config``,
torch-free, read by the frontend too); ``registry`` maps an architecture name to its class."""
