"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "935174a440542f8fc6f6f790560e6446b0ae9fd7690b0fd2833de0e123f28113"
