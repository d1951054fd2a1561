"""KV connectors: full KV blocks saved to and loaded from outside the engine (S7 ``remote_kv``).

- :mod:`.base`: the interface a connector implements, and its counters.
- :mod:`.shared_storage`: ``SharedStorageConnector``, one file per block on a filesystem.
- :mod:`.transfer`: the engine's side: asks the store at admission, runs the loads the
  scheduler starts, reports them back before the next step, saves newly full blocks.
"""

from fastsched.engine.kv_connector.base import BlockLoad, KVConnector, KVConnectorStats, StoreIdentity
from fastsched.engine.kv_connector.shared_storage import SharedStorageConnector
from fastsched.engine.kv_connector.transfer import KVTransfer

__all__ = ["BlockLoad", "KVConnector", "KVConnectorStats", "KVTransfer", "SharedStorageConnector", "StoreIdentity"]
