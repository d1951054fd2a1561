"""KV connectors: full KV blocks saved to and loaded from outside the engine (S7 ``remote_kv``).

- :mod:`.base`: the interface a connector implements, and its counters.
- :mod:`.identity`: whose blocks a store holds (the weights' fingerprint).
- :mod:`.shared_storage`: ``SharedStorageConnector``, one file per block on a filesystem.
- :mod:`.transfer`: the engine's side: asks the store at admission, runs the loads the
  scheduler starts, reports them back before the next step, saves newly full blocks.
"""

from fastsched.engine.kv_connector.base import (
    BlockContents,
    BlockLoad,
    KVConnector,
    KVConnectorStats,
    StoreIdentity,
)
from fastsched.engine.kv_connector.identity import store_identity, weights_fingerprint
from fastsched.engine.kv_connector.shared_storage import SharedStorageConnector
from fastsched.engine.kv_connector.transfer import KVTransfer

__all__ = [
    "BlockContents",
    "BlockLoad",
    "KVConnector",
    "KVConnectorStats",
    "KVTransfer",
    "SharedStorageConnector",
    "StoreIdentity",
    "store_identity",
    "weights_fingerprint",
]
