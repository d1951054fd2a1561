"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "69504194a3ed74f5b169632157444c3be759d84e25fda582b92ae6cf09549587"
