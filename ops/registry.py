"""Which implementations of each op exist on this machine, and which one ``torch.ops.neo`` runs.

Implementations, in order of precedence on their device:

- ``cuda``: CUDA kernels from ``ops_cuda/`` (extension ``neo.ops._cuda_kernels``), CUDA key.
- ``ispc``: ISPC kernels + C++ driver from ``ops_cpu/`` (``neo.ops._cpu_kernels``), CPU key.
- ``numba``: ``numba_kernels.py``; the CPU kernel of ``torch.ops.neo`` when ISPC is absent.
- ``reference``: ``reference.py``; ``CompositeExplicitAutograd``, so it serves every device and
  every op no faster kernel covers.

Each available implementation is reachable as ``torch.ops.neo_<name>.<op>``. Tests and
benchmarks take their lists from ``implementations()``, so a missing build shows up as an
unavailable entry with its reason, never as silence.
"""

import functools
import hashlib
import importlib
from dataclasses import dataclass

import torch

from . import library, reference
from .schemas import OP_NAMES

ISPC_OPS = ("paged_decode_attention", "store_kv_cache")
NUMBA_OPS = ("paged_decode_attention",)
CUDA_OPS = OP_NAMES


@dataclass(frozen=True)
class Implementation:
    """One implementation of one op."""

    name: str
    op: str
    devices: tuple[str, ...]
    available: bool
    note: str = ""

    @property
    def function(self):
        """The implementation as an op: ``torch.ops.neo_<name>.<op>``."""
        if not self.available:
            raise RuntimeError(f"{self.name} implementation of neo.{self.op} is not available: "
                               f"{self.note}")
        return getattr(getattr(torch.ops, f"neo_{self.name}"), self.op)

    @property
    def label(self) -> str:
        return f"{self.op}[{self.name}]"


_implementations: dict[str, list[Implementation]] = {op: [] for op in OP_NAMES}
_dispatch: dict[tuple[str, str], str] = {}
_loaded_files: dict[str, str] = {}  # compiled implementation name -> its extension's file


def _add(name: str, op: str, devices: tuple[str, ...], available: bool, note: str = "") -> None:
    _implementations[op].append(Implementation(name, op, devices, available, note))


def _has_kernel(qualified_name: str, dispatch_key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, dispatch_key)


def _load_extension(module: str) -> tuple[bool, str, str]:
    """(loaded, why not, the extension's file)."""
    try:
        extension = importlib.import_module(module)
    except ImportError as error:
        return False, f"not built ({error})", ""
    return True, "", extension.__file__


def _register_reference() -> None:
    library.declare("neo_reference", OP_NAMES)
    for op in OP_NAMES:
        function = reference.IMPLEMENTATIONS[op]
        for namespace in ("neo", "neo_reference"):
            library.library(namespace).impl(op, function, "CompositeExplicitAutograd")
        _add("reference", op, ("cpu", "cuda"), True)
        for device in ("cpu", "cuda"):
            _dispatch[(op, device)] = "reference"


def _register_compiled(name: str, module: str, ops, dispatch_key: str, device: str) -> bool:
    """Declare ``neo_<name>`` and check that the extension registered its kernels there."""
    loaded, reason, path = _load_extension(module)
    if loaded:
        library.declare(f"neo_{name}", ops)
        _loaded_files[name] = path
    for op in ops:
        ok = loaded and _has_kernel(f"neo_{name}::{op}", dispatch_key)
        if loaded and not ok:
            reason = f"{module} has no {dispatch_key} kernel for {op}; rebuild the package"
        _add(name, op, (device,), ok, "" if ok else reason)
        if ok and _has_kernel(f"neo::{op}", dispatch_key):
            _dispatch[(op, device)] = name
    return loaded


def _register_numba() -> None:
    try:
        import numba  # noqa: F401
    except ImportError as error:
        for op in NUMBA_OPS:
            _add("numba", op, ("cpu",), False, f"numba is not installed ({error})")
        return
    from . import numba_kernels

    library.declare("neo_numba", NUMBA_OPS)
    for op in NUMBA_OPS:
        function = numba_kernels.IMPLEMENTATIONS[op]
        library.library("neo_numba").impl(op, function, "CPU")
        if not _has_kernel(f"neo::{op}", "CPU"):
            library.library("neo").impl(op, function, "CPU")
            _dispatch[(op, "cpu")] = "numba"
        _add("numba", op, ("cpu",), True)


def _register_all() -> None:
    _register_reference()
    _register_compiled("cuda", "neo.ops._cuda_kernels", CUDA_OPS, "CUDA", "cuda")
    _register_compiled("ispc", "neo.ops._cpu_kernels", ISPC_OPS, "CPU", "cpu")
    _register_numba()


def implementations(op: str, device: str | None = None,
                    available_only: bool = True) -> list[Implementation]:
    """Implementations of ``op``, optionally only those that run on ``device`` ('cpu'/'cuda')."""
    if op not in _implementations:
        raise KeyError(f"unknown neo op {op!r}; known ops: {', '.join(OP_NAMES)}")
    return [impl for impl in _implementations[op]
            if (device is None or device in impl.devices) and (impl.available or not available_only)]


def build_fingerprints() -> dict[str, str]:
    """A digest of each loaded compiled extension's file, by implementation name ('cuda',
    'ispc'): anything measured with these kernels (a perf profile) is stale once they change.
    Read once per process (the code it describes is the one loaded)."""
    return dict(_file_digests())


@functools.cache
def _file_digests() -> tuple[tuple[str, str], ...]:
    digests = []
    for name, path in sorted(_loaded_files.items()):
        with open(path, "rb") as file:
            digests.append((name, hashlib.sha256(file.read()).hexdigest()[:16]))
    return tuple(digests)


def dispatched(op: str, device: str) -> str:
    """Name of the implementation ``torch.ops.neo.<op>`` runs for tensors on ``device``."""
    return _dispatch[(op, device)]


_register_all()
