"""What both ends of the gateway ↔ frontend gRPC hop agree on beyond the ``.proto``:
the metadata keys that carry an error's details and the API key, and the message size limit."""

from __future__ import annotations

REJECTION_REASON_KEY = "rejection-reason"  # an UNAVAILABLE's admission reason (A5)
INVALID_PARAM_KEY = "invalid-param"  # the request field an INVALID_ARGUMENT is about
AUTHORIZATION_KEY = "authorization"  # "Bearer <key>" on every call when the server has an API key
# A long prompt sent as token ids (the gateway's chat path) outgrows gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
