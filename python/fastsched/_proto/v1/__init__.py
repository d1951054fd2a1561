"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "3558fb24c42db1e05dbdd1e24c3472f08f97957925f48f6629cdf59524eb3f2e"
