"""The live actors of the cluster this process is connected to, from Ray's own actor table: what a test reads to
find a stage's workers (to count them, or kill one) without looking at the machine's processes, which include
the other pytest worker's cluster and the multi-node scripts' clusters."""

from __future__ import annotations


def live_actors(class_name: str) -> list[dict]:
    """The table's entries (ids, node in `Address`, `Pid`) of the live actors whose class name holds `class_name`
    (Ray Data names a pool's actor class after the map it runs: `MapWorker(MapBatches(_StageWorker))`)."""
    from ray._private.state import actors

    return [a for a in actors().values()
            if a["State"] == "ALIVE" and class_name in a["ActorClassName"]]


def live_actor_ids(class_name: str) -> set[str]:
    """The ids of `live_actors(class_name)`: what a test compares before and after a step to see which it left."""
    return {a["ActorID"] for a in live_actors(class_name)}
