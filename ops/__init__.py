"""The neo op library: ``torch.ops.neo.*``.

Importing this package declares every op (``schemas``), registers the pure-torch reference,
loads the compiled CPU (ISPC) and CUDA kernels when they were built, and falls back to the
numba kernel on the CPU when ISPC was not. ``python -m neo.ops`` lists what is available;
``register_kernel`` adds a kernel by name and ``select_implementation`` picks one (see
``registry``).
"""

from . import library, registry
from .registry import (Implementation, build_fingerprints, dispatched, implementations, ispc_bf16_decode_variant,
                       register_kernel, select_implementation)
from .schemas import OP_NAMES, SCHEMAS

__all__ = ["OP_NAMES", "SCHEMAS", "Implementation", "build_fingerprints", "dispatched", "implementations",
           "ispc_bf16_decode_variant", "library", "register_kernel", "registry", "select_implementation"]
