"""``--kv-transfer-config``: the KV connector an engine uses, in vLLM's JSON shape.

    {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"shared_storage_path": "/mnt/kv", "max_size": "64GiB"}}

``kv_connector_extra_config`` keys (:data:`EXTRA_DEFAULTS`):

- ``shared_storage_path`` (required): the store's directory.
- ``max_size``: bytes of block files this engine lets the store hold (a number or a size
  such as ``"64GiB"``); past it the least recently used blocks are deleted. Default 64 GiB.
- ``load_timeout_s``: a load not read within this many seconds is given up (its blocks
  are computed). Default 30.
- ``lookup_timeout_s``: how long admission waits for the store to say what it holds;
  past it the request is a miss. Default 1.

Parsed and checked here, where flags are read (no torch); the engine builds the connector
from it (``fastsched.engine.kv_connector``). Every error names the field and the value.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from fastsched.json_flags import json_object
from fastsched.units import parse_bytes

CONNECTORS = ("SharedStorageConnector",)
# kv_producer saves full blocks, kv_consumer loads them, kv_both does both.
ROLES = ("kv_producer", "kv_consumer", "kv_both")
_FIELDS = ("kv_connector", "kv_role", "kv_connector_extra_config")
EXTRA_DEFAULTS: dict[str, Any] = {"max_size": 64 * 2**30, "load_timeout_s": 30.0, "lookup_timeout_s": 1.0}
_EXTRA_FIELDS = ("shared_storage_path", *EXTRA_DEFAULTS)


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector must be one of {', '.join(CONNECTORS)}; "
                f"got {self.kv_connector!r}"
            )
        if self.kv_role not in ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role must be one of {', '.join(ROLES)}; got {self.kv_role!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config must be an object; "
                f"got {self.kv_connector_extra_config!r}"
            )
        extra = self.kv_connector_extra_config
        name = "kv_transfer_config.kv_connector_extra_config"
        unknown = sorted(set(extra) - set(_EXTRA_FIELDS))
        if unknown:
            raise ValueError(f"{name} has unknown fields {unknown}; known: {', '.join(_EXTRA_FIELDS)}")
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError(
                f"{name}.shared_storage_path must be a non-empty string (the store's directory); got {path!r}"
            )
        _max_size(extra.get("max_size", EXTRA_DEFAULTS["max_size"]))
        for key in ("load_timeout_s", "lookup_timeout_s"):
            value = extra.get(key, EXTRA_DEFAULTS[key])
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ValueError(f"{name}.{key} must be a number of seconds in (0, 3600]; got {value!r}")

    @property
    def shared_storage_path(self) -> str:
        return self.kv_connector_extra_config["shared_storage_path"]

    @property
    def max_size(self) -> int:
        """Bytes of block files the store may hold (``max_size``)."""
        return _max_size(self.kv_connector_extra_config.get("max_size", EXTRA_DEFAULTS["max_size"]))

    @property
    def load_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("load_timeout_s", EXTRA_DEFAULTS["load_timeout_s"]))

    @property
    def lookup_timeout_s(self) -> float:
        return float(
            self.kv_connector_extra_config.get("lookup_timeout_s", EXTRA_DEFAULTS["lookup_timeout_s"])
        )

    @property
    def is_producer(self) -> bool:
        """Saves the blocks it computes."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Loads the blocks it finds in the store."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> KVTransferConfig:
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown fields {unknown}; known: {', '.join(_FIELDS)}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config.kv_connector is required")
        return cls(**value)

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """The flag's value: a JSON object."""
        return cls.from_dict(json_object(text, "kv_transfer_config"))

    @classmethod
    def of(cls, value: KVTransferConfig | dict[str, Any] | str) -> KVTransferConfig:
        """From what ``LLM(kv_transfer_config=...)`` or a flag gives: the config, a dict or JSON."""
        if isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, str):
            return cls.from_json(value)
        raise ValueError(f"kv_transfer_config must be a JSON string or an object; got {value!r}")


def _max_size(value: object) -> int:
    bad = ValueError(
        "kv_transfer_config.kv_connector_extra_config.max_size must be a positive number of bytes "
        f'or a size such as "64GiB"; got {value!r}'
    )
    if isinstance(value, str):
        try:
            value = parse_bytes(value)
        except argparse.ArgumentTypeError:
            raise bad from None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise bad
    return value


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """``--kv-transfer-config``'s type: argparse shows this error's text (it hides a ValueError's)."""
    try:
        return KVTransferConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
