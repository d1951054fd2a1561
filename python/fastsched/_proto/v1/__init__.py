"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "2af54d98d6fa6e0965c65fd604e70f279bea4ac7e6e62120d572fc6439404807"
