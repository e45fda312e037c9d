"""``BlockManager``: owns the compute-device and host KV block pools. Pure Python."""

from neo.request import KVLocation, Request


class OutOfBlocksError(RuntimeError):
    """A pool has fewer free blocks than an allocation needs (callers check first)."""


class BlockPool:
    """Free list of one pool's block ids."""

    def __init__(self, location: KVLocation, num_blocks: int):
        self.location = location
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"{self.location.value} KV pool: {count} blocks requested, "
                                   f"{len(self._free)} free of {self.num_blocks}")
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        taken.reverse()
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class BlockManager:
    """Allocates, grows, frees and moves requests' block tables between the two pools.

    A request's blocks all live in one pool (``request.location``). Swaps are planned here and
    returned as ``(source_block, destination_block)`` pairs for ``KVCache`` to copy; the source
    blocks are free again as soon as the plan is made, which is safe because the copies are
    ordered before any later write on the executing side.
    """

    def __init__(self, num_gpu_blocks: int, num_host_blocks: int, block_size: int):
        self.block_size = block_size
        self.pools = {
            KVLocation.GPU: BlockPool(KVLocation.GPU, num_gpu_blocks),
            KVLocation.HOST: BlockPool(KVLocation.HOST, num_host_blocks),
        }

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free(self, location: KVLocation) -> int:
        return self.pools[location].num_free

    def num_total(self, location: KVLocation) -> int:
        return self.pools[location].num_blocks

    def can_allocate(self, num_tokens: int, location: KVLocation, reserve: int = 0) -> bool:
        return self.blocks_for(num_tokens) + reserve <= self.pools[location].num_free

    def allocate(self, request: Request, location: KVLocation) -> None:
        """Give a request that holds no blocks room for all its tokens in ``location``."""
        assert not request.block_table, f"{request} already holds blocks"
        request.block_table = self.pools[location].allocate(self.blocks_for(request.num_tokens))
        request.location = location

    def needs_new_block(self, request: Request) -> bool:
        """Whether storing the request's newest token needs one more block."""
        return len(request.block_table) < self.blocks_for(request.num_tokens)

    def append_slot(self, request: Request) -> None:
        """Grow the request's table to hold ``request.num_tokens`` tokens (at most one block)."""
        if self.needs_new_block(request):
            request.block_table += self.pools[request.location].allocate(1)

    def free(self, request: Request) -> None:
        if request.block_table:
            self.pools[request.location].free(request.block_table)
        request.block_table = []
        request.location = None

    def can_move(self, request: Request, destination: KVLocation, reserve: int = 0) -> bool:
        return len(request.block_table) + reserve <= self.pools[destination].num_free

    def move(self, request: Request, destination: KVLocation) -> list[tuple[int, int]]:
        """Re-home a request's blocks in ``destination``; returns the copies to perform."""
        source = request.location
        assert source is not None and source is not destination
        new_blocks = self.pools[destination].allocate(len(request.block_table))
        mapping = list(zip(request.block_table, new_blocks))
        self.pools[source].free(request.block_table)
        request.block_table = new_blocks
        request.location = destination
        return mapping

    def usage(self, location: KVLocation) -> float:
        pool = self.pools[location]
        return pool.num_used / pool.num_blocks if pool.num_blocks else 0.0
