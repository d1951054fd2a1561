"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "de00c91a6dc65b421abb6b5807e33d3b2286de3c9fe9621ee2fd4be70896ff27"
