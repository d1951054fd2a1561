"""Where the Ray actors of a tensor-parallel group run (``--distributed-executor-backend ray``).

One placement group per engine, one bundle (a GPU, or a CPU) per rank. With ``PACK`` (the
default) or ``STRICT_PACK`` the bundles are those of ranks 1..N-1 only, packed onto as few
nodes as Ray can: the engine's own rank 0 needs no reservation beside it. With ``SPREAD``
or ``STRICT_SPREAD`` (each rank on a node of its own: one rank per machine) rank 0 gets a
bundle too, pinned to the engine's node (its ``ray.io/node-id`` label), so that Ray
spreads the others away from it.
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
    from ray.util.placement_group import (
        NODE_ID_LABEL_KEY,
        placement_group,
        placement_group_table,
        remove_placement_group,
    )

    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"ray_placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}")
    bundle = {"GPU": 1} if use_gpu else {"CPU": 1}
    own_node = ray.get_runtime_context().get_node_id()
    with_rank_0 = strategy.endswith("SPREAD")
    if with_rank_0:
        group = placement_group(
            [bundle] * size,
            strategy=strategy,
            bundle_label_selector=[{NODE_ID_LABEL_KEY: own_node}] + [{}] * (size - 1),
        )
    else:
        group = placement_group([bundle] * (size - 1), strategy=strategy)
    try:
        ray.get(group.ready(), timeout=READY_TIMEOUT_S)
        placed = placement_group_table(group)["bundles_to_node_id"]
        bundle_nodes = [placed[i] for i in range(group.bundle_count)]
        if not with_rank_0:
            return Placement(group, list(range(size - 1)), [own_node, *bundle_nodes])
        if bundle_nodes[0] != own_node:  # the label selector is Ray's to honour
            raise ValueError(
                f"the {strategy} placement group put rank 0's bundle on node {bundle_nodes[0]}, "
                f"not on the engine's node {own_node}"
            )
        return Placement(group, list(range(1, size)), bundle_nodes)
    except BaseException:
        remove_placement_group(group)
        raise
