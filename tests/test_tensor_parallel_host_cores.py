"""How the host's cores are divided between tensor-parallel ranks (``neo.runner.host_cores``):
on this machine's own topology, on a two-node topology written as a sysfs tree, and the
pinning of a host-attention thread."""

import os

import pytest

from neo.runner.host_cores import available_cores, numa_nodes, parse_cpu_list, rank_cores
from neo.runner.host_worker import HostAttentionWorker


def write_nodes(root, cpu_lists: list[str]) -> str:
    """A ``/sys/devices/system/node`` look-alike with one ``nodeN/cpulist`` per entry."""
    for index, cpu_list in enumerate(cpu_lists):
        node = root / f"node{index}"
        node.mkdir()
        (node / "cpulist").write_text(cpu_list + "\n")
    (root / "online").write_text(f"0-{len(cpu_lists) - 1}\n")  # not a node directory
    return str(root)


@pytest.mark.parametrize("text, cores", [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,4,6-7\n", [0, 1, 4, 6, 7]),
                                         ("", [])])
def test_cpu_lists_parse(text, cores):
    assert parse_cpu_list(text) == cores


def test_this_machine_is_divided_between_two_ranks():
    available = available_cores()
    nodes = [[core for core in node if core in available] for node in numa_nodes()]
    nodes = [node for node in nodes if node]
    assert nodes, "a Linux host lists its NUMA nodes under /sys/devices/system/node"
    shares = [rank_cores(rank, 2) for rank in range(2)]
    assert {pin for _, pin in shares} == {len(nodes) > 1}
    for cores, _ in shares:  # each rank's share lies within one node
        assert any(set(cores) <= set(node) for node in nodes)
    if len(nodes) == 1 and len(available) >= 2:  # one node: the two shares split it
        assert shares[0][0] + shares[1][0] == available
    assert rank_cores(0, 1) == (nodes[0], len(nodes) > 1)


def test_ranks_spread_over_two_nodes(tmp_path):
    nodes = numa_nodes(write_nodes(tmp_path, ["0-3", "4-7"]))
    assert nodes == [[0, 1, 2, 3], [4, 5, 6, 7]]
    available = list(range(8))
    assert [rank_cores(rank, 2, available, nodes) for rank in range(2)] == [([0, 1, 2, 3], True),
                                                                           ([4, 5, 6, 7], True)]
    assert [rank_cores(rank, 4, available, nodes)[0] for rank in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Cores this process may not use are left out; three ranks share two nodes unevenly.
    assert [rank_cores(rank, 3, [0, 1, 2, 4, 5, 6, 7], nodes)[0] for rank in range(3)] == [[0, 1], [2], [4, 5, 6, 7]]
    # A node without available cores takes no rank: one node is left, nothing is pinned.
    assert rank_cores(1, 2, [0, 1, 2, 3], nodes) == ([2, 3], False)


def test_one_node_splits_into_contiguous_runs(tmp_path):
    nodes = numa_nodes(write_nodes(tmp_path, ["0-4"]))
    assert [rank_cores(rank, 2, list(range(5)), nodes) for rank in range(2)] == [([0, 1, 2], False),
                                                                                ([3, 4], False)]
    assert rank_cores(2, 3, [0], nodes) == ([0], False)  # more ranks than cores: they share


def test_a_pinned_host_attention_thread_runs_on_its_cores():
    core = available_cores()[-1]
    worker = HostAttentionWorker(1, [core])
    try:
        assert worker.submit(lambda: os.sched_getaffinity(0)).result(timeout=30) == {core}
    finally:
        worker.shutdown()
    assert os.sched_getaffinity(0) == set(available_cores())  # the caller's thread is not pinned
