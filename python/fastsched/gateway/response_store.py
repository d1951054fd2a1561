"""The responses ``/v1/responses`` keeps, for ``GET /v1/responses/{id}`` and ``previous_response_id``.

vLLM keeps them only when enabled (``VLLM_ENABLE_RESPONSES_API_STORE``, off by default), in
its API server's memory, without a bound. fastsched does the same but bounded: off unless
``--responses-store-size N`` is given, then at most ``N`` responses in the gateway's memory,
the oldest forgotten first. Each entry is one response and its conversation, which had to fit
the model's context, so ``N`` bounds what clients can make the server keep. With the store
off a request's ``store: true`` (OpenAI's default) is answered but not kept, and its
response says ``"store": false``, as vLLM's does; several gateways each keep their own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response as it was answered
    conversation: list[dict[str, Any]]  # its chat messages and its answer, without the instructions


class ResponseStore:
    def __init__(self, max_entries: int = 0) -> None:
        if max_entries < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)
