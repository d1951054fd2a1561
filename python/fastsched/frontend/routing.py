"""Which engine a request goes to with data parallelism (``--routing``, issue 26 item 2).

``load`` sends a request to the healthy engine with the fewest sequences in flight from
this frontend. ``prefix`` (the default when there is more than one engine) sends it to the
engine that holds the longest prefix of its prompt in its prefix cache (S8), unless that
engine has more than ``load_bound`` sequences in flight above the least-loaded one: a
shared system prompt is then prefilled once per server, not once per engine.

What an engine holds is known from a :class:`PrefixSummary`, fed by the engines' KV_EVENTS
(hashes cached and evicted, ``engine.protocol.KvEvents``) and, at once, by this frontend's
own routing: a prompt sent to an engine will be cached there, and the requests that follow
it before its events arrive must find it. The prompt's hashes are the core's own
(``fastsched._core.BlockHasher``), with the request's adapter id and cache salt, so a
summary entry and an engine's cached block agree by construction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fastsched._core import BlockHasher
from fastsched.engine.protocol import ModelInfo
from fastsched.frontend.settings import FrontendSettings

ROUTING_POLICIES = ("prefix", "load")
# Why an engine was chosen (the label of fastsched:routing_decisions_total).
CAUSE_PREFIX = "prefix"  # it holds the longest cached prefix
CAUSE_LOAD = "load"  # least loaded: no engine holds a prefix, or --routing load
CAUSE_OVERLOADED = "overloaded"  # least loaded: the engine with the longest prefix is beyond the bound
ROUTING_CAUSES = (CAUSE_PREFIX, CAUSE_LOAD, CAUSE_OVERLOADED)


@dataclass(frozen=True)
class RoutingDecision:
    """An engine and why (shown in ``/debug/requests/{id}``)."""

    engine: int
    cause: str
    cached_blocks: int  # blocks of the prompt the chosen engine holds, as far as the summary knows
    best_blocks: int  # the longest cached prefix on any candidate engine, in blocks

    def describe(self) -> str:
        """One line for people: ``overloaded (1 prompt blocks cached there; 4 on the best engine)``."""
        return f"{self.cause} ({self.cached_blocks} prompt blocks cached there; {self.best_blocks} on the best engine)"


class PrefixSummary:
    """Which engines hold which block hashes: a bitmask of engines per hash, at most
    ``max_blocks`` hashes, the least recently used forgotten first. Forgetting is safe:
    it only makes a hit look like a miss."""

    def __init__(self, max_blocks: int) -> None:
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise ValueError(f"routing summary max_blocks must be a positive integer, got {max_blocks!r}")
        self.max_blocks = max_blocks
        self._engines: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._engines)

    def store(self, engine: int, hashes: Iterable[int]) -> None:
        bit = 1 << engine
        entries = self._engines
        for h in hashes:
            entries[h] = entries.get(h, 0) | bit
            entries.move_to_end(h)
        while len(entries) > self.max_blocks:
            entries.popitem(last=False)

    def remove(self, engine: int, hashes: Iterable[int]) -> None:
        keep = ~(1 << engine)
        entries = self._engines
        for h in hashes:
            mask = entries.get(h)
            if mask is not None:
                if mask & keep:
                    entries[h] = mask & keep
                else:
                    del entries[h]

    def forget_engine(self, engine: int) -> None:
        """An engine died or restarted: its cache is gone."""
        self.remove(engine, list(self._engines))

    def prefix_blocks(self, hashes: Sequence[int], engines: Iterable[int]) -> dict[int, int]:
        """For each of ``engines``: how many leading blocks of ``hashes`` it holds. The
        hashes that matched become the most recently used."""
        lengths = dict.fromkeys(engines, 0)
        live = 0
        for e in lengths:
            live |= 1 << e
        entries = self._engines
        for i, h in enumerate(hashes):
            mask = entries.get(h, 0) & live
            if not mask:
                break
            entries.move_to_end(h)
            for e in lengths:
                if mask >> e & 1:
                    lengths[e] = i + 1
            live = mask
        return lengths


class Router:
    """Chooses an engine for each request (module docstring) and counts its decisions."""

    def __init__(self, policy: str, hasher: BlockHasher | None, *, max_blocks: int, load_bound: int) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if isinstance(load_bound, bool) or not isinstance(load_bound, int) or load_bound < 0:
            raise ValueError(f"routing load_bound must be a non-negative integer, got {load_bound!r}")
        self.policy = policy if hasher is not None else "load"
        self.hasher = hasher
        self.load_bound = load_bound
        self.summary = PrefixSummary(max_blocks)
        self.decisions_total = dict.fromkeys(ROUTING_CAUSES, 0)

    def choose(
        self,
        token_ids: Sequence[int],
        engines: Sequence[int],
        in_flight: Sequence[int],
        *,
        lora_id: int | None = None,
        cache_salt: str | None = None,
    ) -> RoutingDecision:
        """The engine for a prompt among the healthy ``engines`` (not empty), given each
        one's sequences in flight; with ``prefix``, the prompt's blocks are then counted as
        held by the chosen engine."""
        least = min(engines, key=lambda e: (in_flight[e], e))  # ties: lowest index
        if self.policy == "load":
            return self._count(RoutingDecision(least, CAUSE_LOAD, 0, 0))
        assert self.hasher is not None
        hashes = self.hasher.prompt_hashes(list(token_ids), lora_id, cache_salt).tolist()
        held = self.summary.prefix_blocks(hashes, engines)
        best_blocks = max(held.values())
        if best_blocks == 0:
            decision = RoutingDecision(least, CAUSE_LOAD, 0, 0)
        else:
            best = min((e for e in engines if held[e] == best_blocks), key=lambda e: (in_flight[e], e))
            if in_flight[best] > in_flight[least] + self.load_bound:
                decision = RoutingDecision(least, CAUSE_OVERLOADED, held[least], best_blocks)
            else:
                decision = RoutingDecision(best, CAUSE_PREFIX, best_blocks, best_blocks)
        self.summary.store(decision.engine, hashes)
        return self._count(decision)

    def _count(self, decision: RoutingDecision) -> RoutingDecision:
        self.decisions_total[decision.cause] += 1
        return decision

    def on_kv_events(self, engine: int, stored: Iterable[int], removed: Iterable[int]) -> None:
        """An engine's KV_EVENTS: removals first, as an evicted block may be cached again
        in the same step."""
        if self.policy == "prefix":
            self.summary.remove(engine, removed)
            self.summary.store(engine, stored)

    def forget_engine(self, engine: int) -> None:
        """An engine died or restarted with an empty cache."""
        if self.policy == "prefix":
            self.summary.forget_engine(engine)


def router_for(settings: FrontendSettings, info: ModelInfo, num_engines: int) -> Router:
    """The frontend's router: ``prefix`` needs more than one engine and the engines' prefix
    caching on; it hashes as they do (their block size and ``--prefix-caching-hash-algo``)."""
    cache = info.cache_config
    prefix = (
        settings.routing == "prefix"
        and num_engines > 1
        and cache.get("enable_prefix_caching", "True") == "True"
    )
    hasher = (
        BlockHasher(info.block_size, cache.get("prefix_caching_hash_algo", "builtin")) if prefix else None
    )
    return Router(
        settings.routing,
        hasher,
        max_blocks=settings.routing_summary_blocks,
        load_bound=settings.routing_load_bound,
    )
