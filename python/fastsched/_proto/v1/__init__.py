"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "d8981c1e898fa8844fe45a3852eee85a2e021ea86682530dea6114506dcf9177"
