"""Where the Ray actors of a tensor-parallel group run (``--distributed-executor-backend ray``).

One placement group per engine, one bundle (a GPU, or a CPU) per rank. With ``PACK`` (the
default) or ``STRICT_PACK`` the bundles are those of ranks 1..N-1 only, packed onto as few
nodes as Ray can: the engine's own rank 0 needs no reservation beside it. With ``SPREAD``
or ``STRICT_SPREAD`` (each rank on a node of its own: one rank per machine) rank 0 gets a
bundle too, so that Ray spreads the others away from it; it takes the bundle Ray placed on
the engine's node, and a placement that left none there is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
READY_TIMEOUT_S = 120


@dataclass
class Placement:
    """The placement group and, for ranks 1..N-1, the bundle and the node each runs on."""

    group: Any  # ray.util.placement_group.PlacementGroup
    bundles: list[int]  # bundles[r - 1]: rank r's bundle index
    nodes: list[str]  # the node id of each rank, rank 0's (the engine's) first


def place_ranks(size: int, use_gpu: bool, strategy: str) -> Placement:
    """Reserves the bundles of a group of ``size`` ranks (Ray initialized) and waits for them."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"ray_placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}")
    bundle = {"GPU": 1} if use_gpu else {"CPU": 1}
    with_rank_0 = strategy.endswith("SPREAD")
    group = placement_group([bundle] * (size if with_rank_0 else size - 1), strategy=strategy)
    try:
        ray.get(group.ready(), timeout=READY_TIMEOUT_S)
        own_node = ray.get_runtime_context().get_node_id()
        bundle_nodes = [placement_group_table(group)["bundles_to_node_id"][i] for i in range(group.bundle_count)]
        if not with_rank_0:
            return Placement(group, list(range(size - 1)), [own_node, *bundle_nodes])
        if own_node not in bundle_nodes:
            raise ValueError(f"the {strategy} placement group of tensor_parallel_size {size} has no bundle on the "
                             f"engine's node {own_node} (its bundles are on {bundle_nodes}): start the engine on "
                             f"a node of the cluster with a free {next(iter(bundle))}")
        rank_0 = bundle_nodes.index(own_node)
        others = [i for i in range(size) if i != rank_0]
        return Placement(group, others, [own_node, *(bundle_nodes[i] for i in others)])
    except BaseException:
        remove_placement_group(group)
        raise
