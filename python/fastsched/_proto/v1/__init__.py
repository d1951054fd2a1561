"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "6f2eb1de5fa74c9550182863804f7eb4ae532cfae31c82fdb53f01cadcab47ea"
