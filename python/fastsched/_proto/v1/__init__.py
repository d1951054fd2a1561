"""Generated from proto/fastsched/v1/generate.proto by `python -m fastsched.proto_gen`; do not edit."""

SOURCE_SHA256 = "170b19eec49ad0c106c6a2a219ba7a3843e78d241f83c0e314970530c43b770e"
