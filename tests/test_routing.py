"""Prefix-aware engine choice (``frontend.routing``, issue 26 item 2) on constructed summaries.

Block size 4 throughout; a prompt of 12 tokens has three full blocks.
"""

from __future__ import annotations

import pytest

from fastsched._core import BlockHasher, Scheduler, SchedulerConfig
from fastsched.engine.protocol import ModelInfo
from fastsched.frontend.routing import (
    CAUSE_LOAD,
    CAUSE_OVERLOADED,
    CAUSE_PREFIX,
    PrefixSummary,
    Router,
    router_for,
)
from fastsched.frontend.settings import FrontendSettings

SYSTEM = list(range(100, 108))  # two blocks shared by a tenant's requests
ENGINES = [0, 1, 2]


def hasher() -> BlockHasher:
    return BlockHasher(4)


def router(policy: str = "prefix", load_bound: int = 8, max_blocks: int = 1000) -> Router:
    return Router(policy, hasher(), max_blocks=max_blocks, load_bound=load_bound)


def held_by(r: Router, engine: int, tokens: list[int], **kw: object) -> None:
    """As if ``engine`` had reported caching the full blocks of ``tokens`` (KV_EVENTS)."""
    r.on_kv_events(engine, hasher().prompt_hashes(tokens, **kw).tolist(), [])


def test_prompt_hashes_are_the_schedulers_own() -> None:
    """S8: the frontend hashes a prompt as the engine's scheduler does: salt, adapter and algorithm."""
    tokens = list(range(1, 11))
    for algo in ("builtin", "sha256"):
        sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=64,
                max_model_len=64,
                block_size=4,
                num_gpu_blocks=32,
                prefix_caching_hash_algo=algo,
                max_loras=1,
            )
        )
        handle = sched.add_request("r", tokens, 1, lora_id=2, cache_salt="s")
        want = sched.block_hashes(handle).tolist()
        assert len(want) == 2
        assert BlockHasher(4, algo).prompt_hashes(tokens, 2, "s").tolist() == want
        assert BlockHasher(4, algo).prompt_hashes(tokens, None, "s").tolist() != want
        assert BlockHasher(4, algo).prompt_hashes(tokens, 2, None).tolist() != want


def test_the_engine_holding_the_longest_prefix_gets_the_request() -> None:
    r = router()
    held_by(r, 0, SYSTEM[:4])
    held_by(r, 2, SYSTEM)
    d = r.choose(SYSTEM + [1, 2, 3, 4], ENGINES, [0, 0, 3])
    assert (d.engine, d.cause, d.cached_blocks, d.best_blocks) == (2, CAUSE_PREFIX, 2, 2)


def test_without_any_cached_prefix_the_least_loaded_engine_wins_ties_to_the_lowest_index() -> None:
    r = router()
    assert r.choose(SYSTEM, ENGINES, [2, 1, 1]).engine == 1
    assert r.choose([7] * 8, ENGINES, [2, 1, 1]).cause == CAUSE_LOAD


def test_a_prefix_must_start_at_the_first_block() -> None:
    """A later block alone is no hit: hashes are chained."""
    r = router()
    r.on_kv_events(1, hasher().prompt_hashes(SYSTEM).tolist()[1:], [])
    assert r.choose(SYSTEM, ENGINES, [0, 0, 0]).cause == CAUSE_LOAD


def test_an_engine_loaded_beyond_the_bound_gives_way_to_the_least_loaded() -> None:
    r = router(load_bound=2)
    held_by(r, 1, SYSTEM)
    assert r.choose(SYSTEM, ENGINES, [0, 2, 5]).cause == CAUSE_PREFIX  # 2 above the least: within the bound
    d = r.choose(SYSTEM, ENGINES, [0, 3, 5])
    assert (d.engine, d.cause, d.best_blocks) == (0, CAUSE_OVERLOADED, 2)


def test_equal_prefixes_go_to_the_less_loaded_holder() -> None:
    r = router()
    held_by(r, 0, SYSTEM)
    held_by(r, 1, SYSTEM)
    assert r.choose(SYSTEM, ENGINES, [3, 1, 0]).engine == 1


def test_an_eviction_event_takes_the_block_away() -> None:
    r = router()
    held_by(r, 0, SYSTEM)
    r.on_kv_events(0, [], hasher().prompt_hashes(SYSTEM).tolist()[1:])
    d = r.choose(SYSTEM, [0, 1], [0, 0])
    assert (d.engine, d.cause, d.cached_blocks) == (0, CAUSE_PREFIX, 1)


def test_a_routed_prompt_counts_as_held_before_its_events_arrive() -> None:
    """Requests right behind the first of a tenant follow it, not the load."""
    r = router()
    first = r.choose(SYSTEM + [1], ENGINES, [1, 0, 0])
    assert (first.engine, first.cause) == (1, CAUSE_LOAD)
    second = r.choose(SYSTEM + [2], ENGINES, [1, 1, 0])
    assert (second.engine, second.cause) == (1, CAUSE_PREFIX)


def test_a_dead_engine_is_forgotten() -> None:
    r = router()
    held_by(r, 2, SYSTEM)
    r.forget_engine(2)
    assert r.choose(SYSTEM, ENGINES, [0, 0, 0]).cause == CAUSE_LOAD


def test_salt_and_adapter_keep_tenants_apart() -> None:
    r = router()
    held_by(r, 2, SYSTEM, cache_salt="a")
    assert r.choose(SYSTEM, ENGINES, [0, 0, 0], cache_salt="b").cause == CAUSE_LOAD
    assert r.choose(SYSTEM, ENGINES, [0, 0, 0], cache_salt="a").engine == 2
    assert r.choose(SYSTEM, ENGINES, [0, 0, 0], lora_id=1, cache_salt="a").cause == CAUSE_LOAD


def test_load_routing_ignores_the_cache_and_counts_decisions() -> None:
    r = router("load")
    held_by(r, 1, SYSTEM)
    assert r.choose(SYSTEM, ENGINES, [0, 0, 0]).engine == 0
    assert r.decisions_total == {CAUSE_PREFIX: 0, CAUSE_LOAD: 1, CAUSE_OVERLOADED: 0}


def test_decisions_are_counted_by_cause() -> None:
    r = router(load_bound=0)
    r.choose(SYSTEM, [0, 1], [0, 0])
    r.choose(SYSTEM, [0, 1], [0, 0])
    r.choose(SYSTEM, [0, 1], [1, 0])
    assert r.decisions_total == {CAUSE_PREFIX: 1, CAUSE_LOAD: 1, CAUSE_OVERLOADED: 1}


def test_the_summary_is_bounded_and_forgets_the_least_recently_used() -> None:
    s = PrefixSummary(max_blocks=3)
    s.store(0, [1, 2, 3])
    assert s.prefix_blocks([1], [0]) == {0: 1}  # 1 is now the most recently used
    s.store(1, [4])
    assert len(s) == 3
    assert s.prefix_blocks([2], [0]) == {0: 0}  # 2 went first
    assert s.prefix_blocks([1], [0, 1]) == {0: 1, 1: 0}


def test_summary_counts_the_leading_blocks_per_engine() -> None:
    s = PrefixSummary(max_blocks=10)
    s.store(0, [1, 2, 3])
    s.store(1, [1, 2])
    s.store(2, [2, 3])
    assert s.prefix_blocks([1, 2, 3, 4], [0, 1, 2]) == {0: 3, 1: 2, 2: 0}
    s.remove(0, [2])
    assert s.prefix_blocks([1, 2, 3], [0, 1, 2]) == {0: 1, 1: 2, 2: 0}


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_a_bad_summary_size_is_named(bad: object) -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixSummary(bad)  # type: ignore[arg-type]


def test_bad_routing_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="routing must be 'prefix' or 'load', got 'random'"):
        FrontendSettings(routing="random")
    with pytest.raises(ValueError, match="routing_summary_blocks"):
        FrontendSettings(routing_summary_blocks=0)
    with pytest.raises(ValueError, match="routing_load_bound"):
        FrontendSettings(routing_load_bound=-1)


def test_prefix_routing_needs_several_engines_and_prefix_caching() -> None:
    info = ModelInfo(
        None,
        "m",
        64,
        100,
        block_size=4,
        cache_config={"enable_prefix_caching": "True", "prefix_caching_hash_algo": "sha256"},
    )
    r = router_for(FrontendSettings(), info, 2)
    assert r.policy == "prefix" and r.hasher is not None and r.hasher.block_size == 4
    assert router_for(FrontendSettings(), info, 1).policy == "load"
    assert router_for(FrontendSettings(routing="load"), info, 2).policy == "load"
    off = ModelInfo(None, "m", 64, 100, block_size=4, cache_config={"enable_prefix_caching": "False"})
    assert router_for(FrontendSettings(), off, 2).policy == "load"
