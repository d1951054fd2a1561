"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "bf38fe5565b9d6dd8c7f6eb0261b1567bc59a56723e044a206ce87bb888e1246"
