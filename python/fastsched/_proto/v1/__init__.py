"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "88c07d9bdeec0520d76888828a9912679f73f40211b22b9e1ebb85871e6cc50e"
