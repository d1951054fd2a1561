"""The KV connector's counters travel engine -> frontend -> gateway and come out as
``fastsched:kv_connector_*_total`` per engine; an engine without a connector has none."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (requirements-serve.txt)")
pytest.importorskip("grpc_tools", reason="the gRPC stubs are generated with grpcio-tools")

from fastsched.engine import protocol
from fastsched.engine.kv_connector.base import KVConnectorStats
from fastsched.frontend.request_metrics import LatencyHistograms
from fastsched.frontend.stats import stats_to_proto
from fastsched.gateway.metrics import KV_CONNECTOR_COUNTERS, render
from fastsched.tools.metrics_snapshot import parse_metrics

COUNTERS = KVConnectorStats(
    queries=5, hits=3, blocks_loaded=12, blocks_saved=20, load_failures=1, load_seconds=0.25, save_seconds=0.5
).as_dict()


def test_every_counter_has_a_metric() -> None:
    assert set(KV_CONNECTOR_COUNTERS) == set(COUNTERS)


def test_engine_counters_reach_metrics_per_engine() -> None:
    with_connector = protocol.EngineStats(kv_connector=COUNTERS)
    # Through the engine's wire format (msgpack) as a heartbeat carries them.
    back = protocol.decode(protocol.encode(protocol.Heartbeat(0, with_connector))).stats
    assert back.kv_connector == COUNTERS
    engines = [
        {"index": 0, **msgspec.structs.asdict(back)},
        {"index": 1, **msgspec.structs.asdict(protocol.EngineStats())},
    ]
    page = parse_metrics(
        render([stats_to_proto({"engines": engines}, LatencyHistograms())], "m").decode(), 0.0
    )
    loaded = page.samples["fastsched:kv_connector_blocks_loaded_total"]
    assert [(s.labels["engine"], s.value) for s in loaded] == [("0", 12.0)], "engine 1 has no connector"
    assert page.samples["fastsched:kv_connector_load_seconds_total"][0].value == 0.25
    assert page.samples["fastsched:kv_connector_hits_total"][0].value == 3.0


def test_a_malformed_counter_is_a_protocol_error() -> None:
    import msgpack

    with pytest.raises(protocol.ProtocolError, match="kv_connector"):
        protocol.decode(msgpack.packb(["heartbeat", 0, {"kv_connector": {"blocks_loaded": "many"}}]))
