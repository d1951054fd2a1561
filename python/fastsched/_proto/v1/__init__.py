"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "541bd6293dccae2c8af985bba1ee57ed6cb49becd22815c816dae8f7251959af"
