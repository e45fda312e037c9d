"""Which host cores the host attention of each tensor-parallel rank runs on.

The host's cores (those this process may use) are divided between the ranks. On a host with
several NUMA nodes (``/sys/devices/system/node/node*/cpulist``) the ranks are spread over the
nodes and each rank's share lies within one node, so a rank's host attention streams the KV it
holds from memory near its cores; its host-attention thread is then pinned to that share
(``HostAttentionWorker``). On one node the shares are equal contiguous runs and nothing is
pinned: the operating system places the threads.
"""

import os

NODE_ROOT = "/sys/devices/system/node"


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list (``"0-3,8,10-11"``) -> its core ids in order."""
    cores = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def numa_nodes(root: str = NODE_ROOT) -> list[list[int]]:
    """The cores of each NUMA node with cores, in node order; empty where ``root`` is absent."""
    if not os.path.isdir(root):
        return []
    nodes = sorted((int(name[len("node"):]), name) for name in os.listdir(root)
                   if name.startswith("node") and name[len("node"):].isdigit())
    result = []
    for _, name in nodes:
        path = os.path.join(root, name, "cpulist")
        if os.path.isfile(path):
            with open(path) as file:
                cores = parse_cpu_list(file.read())
            if cores:
                result.append(cores)
    return result


def available_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_cores(rank: int, size: int, available: list[int] | None = None,
               nodes: list[list[int]] | None = None) -> tuple[list[int], bool]:
    """The cores of rank ``rank`` of ``size`` and whether to pin its host threads to them.

    ``available`` (default: this process's cores) and ``nodes`` (default: ``numa_nodes()``)
    describe the host. Ranks are spread evenly over the nodes that hold available cores (rank r
    on node ``r * nodes // size``); the ranks on one node split its available cores into equal
    contiguous runs, the first runs one core longer when they do not divide. Pinning is asked
    for when there are several such nodes.
    """
    available = available_cores() if available is None else available
    nodes = numa_nodes() if nodes is None else nodes
    usable = set(available)
    node_cores = [[core for core in node if core in usable] for node in nodes]
    node_cores = [cores for cores in node_cores if cores] or [sorted(usable)]
    node = rank * len(node_cores) // size
    peers = [other for other in range(size) if other * len(node_cores) // size == node]
    cores, position = node_cores[node], peers.index(rank)
    share, extra = divmod(len(cores), len(peers))
    start = position * share + min(position, extra)
    mine = cores[start:start + share + (position < extra)] or cores[:1]
    return mine, len(node_cores) > 1
