"""What a pool of actors needs against what the cluster's nodes hold (wbrag_ray.cluster_nodes), by hand: whole
actors per node, each resource counted, and a fix that fits. The refusals on a real cluster, before any actor
starts: tests/stages/test_service.py and tests/retrieval/test_service.py."""

from wbrag_ray.cluster_nodes import pool_refusal, room_for

GIB = 1 << 30


def test_room_counts_whole_actors_per_node_on_every_resource_they_ask():
    nodes = [{"CPU": 8.0, "GPU": 2.0, "memory": 16.0 * GIB}, {"CPU": 3.0, "memory": 64.0 * GIB}]
    assert room_for({"CPU": 1.0}, nodes) == 8 + 3
    assert room_for({"CPU": 1.5}, nodes) == 5 + 2  # 1.5 CPUs: 5 on 8, 2 on 3 (no half actor)
    assert room_for({"CPU": 1.0, "GPU": 1.0}, nodes) == 2  # the GPUs bind; the second node has none
    assert room_for({"CPU": 0.1, "memory": 10.0 * GIB}, nodes) == 1 + 6  # memory binds
    assert room_for({"CPU": 1.0, "GPU": 0.0}, nodes) == 11  # asking 0 of a resource asks nothing of it
    assert room_for({"GPU": 1 / 3}, [{"GPU": 1.0}]) == 3  # not floored to 2 by float rounding


def test_a_pool_that_does_not_fit_is_refused_with_a_fix_that_fits():
    laptop = [{"CPU": 2.0, "memory": 8.0 * GIB}]
    assert pool_refusal("the generate service", 2, {"CPU": 1.0, "GPU": 0.0}, laptop) is None
    why = pool_refusal("the generate service", 3, {"CPU": 1.0, "GPU": 0.0}, laptop)
    assert why == ("the generate service: 3 actors of 1 CPU each do not fit the cluster's 1 node (room for 2); "
                   "lower its concurrency to 2, or add nodes")
    why = pool_refusal("the embed pass", 1, {"CPU": 1.0, "GPU": 1.0}, laptop)  # a GPU stage on a CPU machine
    assert "1 actor of 1 CPU and 1 GPU each" in why and "ask less: the largest node has 0 GPU" in why
    why = pool_refusal("the search pool", 4, {"CPU": 0.1, "memory": 12.0 * GIB}, laptop + laptop)
    assert "12 GiB memory" in why and "the largest node has 8 GiB memory" in why and "2 nodes" in why


def test_a_pool_of_groups_is_told_the_replicas_per_group_that_fit():
    """A search pool of 4 shard groups x 6 replicas, 0.5 CPU each, on 8 CPUs: room for 16 actors, 4 per group."""
    why = pool_refusal("the search pool", 24, {"CPU": 0.5}, [{"CPU": 8.0}], groups=4)
    assert "(room for 16); lower its concurrency to 4" in why
    # fewer actors fit than there are groups: no concurrency fits, the nodes are too small
    assert "lower its concurrency, or add nodes" in pool_refusal("the search pool", 8, {"CPU": 4.0}, [{"CPU": 8.0}],
                                                                  groups=4)
