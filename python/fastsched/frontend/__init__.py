"""The frontend process: admission control (A1–A6), input and output processing
(detokenization, stop strings), request status, and the gRPC server. It talks to
engines over ZMQ with the torch-free wire types of ``fastsched.engine.protocol``
and never loads the model."""
