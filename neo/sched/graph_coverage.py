"""``GraphCoverage``: which iterations the runner replays from captured CUDA graphs.

The runner decides with it which plans replay a graph (``neo.runner.model_runner``), and the
scheduler asks the same object to predict that for the plans it weighs, because a replayed
iteration costs less than the same work launched kernel by kernel. The runner owns it: it fills
it from the graphs it captured and turns pipeline graphs off in it when a capture fails.
"""

from dataclasses import dataclass

from .scheduler_output import SubBatch


@dataclass
class GraphCoverage:
    """Decode-only iterations whose requests' block tables are at most ``max_blocks`` wide:

    - a decode graph covers one sub-batch of at most ``decode_max_requests`` GPU decodes;
    - a pipeline graph covers one or two sub-batches of GPU and host decodes, at most
      ``pipeline_max_requests`` of each kind per sub-batch, with at least one host decode;
    - a host batch of the async host pipeline replays graphs of its own (its sub-batches'
      layers, ``neo.runner.host_batches``) for sub-batches of at most
      ``host_batch_max_requests`` host decodes.

    A maximum of 0 means no such graphs. A plan's swaps do not change what replays: the runner
    queues a replayed plan's block copies ahead of the graph on the compute stream, so they do
    not overlap its layers as an eager iteration's do (the simulator adds their time).
    """

    decode_max_requests: int = 0
    pipeline_max_requests: int = 0
    max_blocks: int = 0
    host_batch_max_requests: int = 0

    def host_batch_graph(self, host_decodes: int) -> bool:
        """Whether a host batch's sub-batch of that many host decodes replays a graph (where
        its requests' contexts are within the graphs', which counts alone do not tell)."""
        return 0 < host_decodes <= self.host_batch_max_requests

    def decode_graph(self, gpu_decodes: int, widest_blocks: int) -> bool:
        """Whether a decode graph covers that many GPU decodes with tables that wide."""
        return 0 < gpu_decodes <= self.decode_max_requests and widest_blocks <= self.max_blocks

    def pipeline_graph(self, gpu_decodes: int, widest_blocks: int) -> bool:
        """Whether a pipeline graph covers a sub-batch of that many GPU decodes (tables that
        wide), whatever host decodes within the limit it has."""
        return (self.pipeline_max_requests > 0 and gpu_decodes <= self.pipeline_max_requests
                and widest_blocks <= self.max_blocks)

    def replays_decode_graph(self, batches: list[SubBatch]) -> bool:
        """Whether the runner replays a decode graph for a plan of these sub-batches (whatever
        swaps the plan has: the runner copies those before the replay)."""
        if len(batches) != 1:
            return False
        batch = batches[0]
        return not batch.prefills and not batch.host_decodes and self.decode_graph(len(batch.gpu_decodes),
                                                                                   widest_gpu_table(batch))

    def replays_pipeline_graph(self, batches: list[SubBatch]) -> bool:
        """Whether the runner replays a pipeline graph for a plan of these sub-batches (whatever
        swaps the plan has, as for decode graphs)."""
        if not batches or not any(batch.host_decodes for batch in batches):
            return False
        return all(not batch.prefills and len(batch.host_decodes) <= self.pipeline_max_requests
                   and self.pipeline_graph(len(batch.gpu_decodes), widest_gpu_table(batch)) for batch in batches)


def widest_gpu_table(batch: SubBatch) -> int:
    """Blocks in the longest block table of the sub-batch's GPU decodes."""
    return max((len(request.block_table) for request in batch.gpu_decodes), default=0)
