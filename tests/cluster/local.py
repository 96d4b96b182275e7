"""A local multi-node Ray cluster (several raylets on this machine) for the node-loss scripts."""

from ray.cluster_utils import Cluster

# A killed raylet is declared dead after 3 missed health checks 1 s apart (Ray's default: 5 checks 3 s apart),
# so a lost node's actors restart elsewhere some 10 s sooner. A live node still has 10 s to answer each check
# (health_check_timeout_ms), ample on a busy 2-CPU machine.
NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def local_cluster(head_cpus: float, dashboard: bool = True) -> Cluster:
    """A head node with `head_cpus` CPUs (the driver's node); add worker nodes with `add_node`. `dashboard`: Ray's
    State API (listing tasks and actors) and Ray Train's placement-group cleaner ask it; elsewhere it is about 1 GB
    of processes for nothing."""
    return Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "_system_config": NODE_DEATH,
                                                         "include_dashboard": dashboard})
