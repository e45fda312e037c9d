"""Which implementations of each op exist on this machine, which one ``torch.ops.neo`` runs, and
how to pick one by name.

Implementations, in order of precedence on their device:

- ``cuda``: CUDA kernels from ``ops_cuda/`` (extension ``neo.ops._cuda_kernels``), CUDA key.
- ``ispc``: ISPC kernels + C++ driver from ``ops_cpu/`` (``neo.ops._cpu_kernels``), CPU key.
- ``numba``: ``numba_kernels.py``; the CPU kernel of ``torch.ops.neo`` when ISPC is absent.
- ``reference``: ``reference.py``; ``CompositeExplicitAutograd``, so it serves every device and
  every op no faster kernel covers.

Kernels added with ``register_kernel`` come after these: they are reachable by name but never
become what ``torch.ops.neo.<op>`` runs.

Each implementation is *native* or not. A native one is compiled and runs without the Python
interpreter (``cuda``, ``ispc``, a compiled kernel added by name); the others are Python
functions (``numba``'s wrappers, ``reference``, a Python kernel added by name). The difference
decides where a kernel may be called from. A CUDA host function (the pipeline's
``torch.classes.neo_pipeline.HostDecodeStage`` runs the host's attention in one) runs on a
thread of the CUDA driver that must never wait for the GIL, so only native kernels may be
called there. From Python both kinds work: ``torch.ops`` releases the GIL while a compiled
kernel runs, so a worker thread calling one runs beside the Python thread, while a Python
kernel holds the GIL for as long as its Python code runs.

Each available implementation is reachable as ``torch.ops.neo_<name>.<op>``. Tests and
benchmarks take their lists from ``implementations()``, so a missing build shows up as an
unavailable entry with its reason, never as silence; the engine picks one with
``select_implementation()``.
"""

import functools
import hashlib
import importlib
from dataclasses import dataclass

import torch
from torch.library import Library

from . import library, reference
from .schemas import OP_NAMES

ISPC_OPS = ("paged_decode_attention", "store_kv_cache")
NUMBA_OPS = ("paged_decode_attention",)
CUDA_OPS = OP_NAMES
BUILT_IN = ("cuda", "ispc", "numba", "reference")
AUTO = "auto"  # select_implementation's name for what torch.ops.neo runs
DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}  # device -> the dispatch key of its kernels


@dataclass(frozen=True)
class Implementation:
    """One implementation of one op.

    ``native``: compiled; runs without the Python interpreter, so the host stage may call it
    from a CUDA host function (see the module docstring). ``note``: why an unavailable
    implementation is unavailable."""

    name: str
    op: str
    devices: tuple[str, ...]
    available: bool
    native: bool
    note: str = ""

    @property
    def function(self):
        """The implementation as an op: ``torch.ops.neo_<name>.<op>``."""
        if not self.available:
            raise RuntimeError(f"{self.name} implementation of neo.{self.op} is not available: "
                               f"{self.note}")
        return getattr(getattr(torch.ops, f"neo_{self.name}"), self.op)

    @property
    def qualified_name(self) -> str:
        """The dispatcher's name of the op: ``neo_<name>::<op>`` (what ``HostDecodeStage``
        takes)."""
        return f"neo_{self.name}::{self.op}"

    @property
    def label(self) -> str:
        return f"{self.op}[{self.name}]"


_implementations: dict[str, list[Implementation]] = {op: [] for op in OP_NAMES}
_loaded_files: dict[str, str] = {}  # compiled implementation name -> its extension's file
# The kernels of torch.ops.neo that neo.ops registered itself: (op, dispatch key) -> {origin of
# the kernel, as the dispatcher reports it: implementation name}. See dispatched().
_neo_kernels: dict[tuple[str, str], dict[str, str]] = {}
# The numba fallback's CPU kernels of torch.ops.neo are registered through this library, whose
# origin (this line) tells them apart from the reference, registered through library.py's.
_neo_fallback_library = Library("neo", "IMPL")


def _add(name: str, op: str, devices: tuple[str, ...], available: bool, native: bool,
         note: str = "") -> Implementation:
    implementation = Implementation(name, op, devices, available, native, note)
    _implementations[op].append(implementation)
    return implementation


def _has_kernel(qualified_name: str, dispatch_key: str) -> bool:
    """Whether a kernel was registered for exactly ``dispatch_key`` (an alias key such as
    ``CompositeExplicitAutograd`` does not count) on an op that may not be declared yet."""
    return (torch._C._dispatch_has_kernel(qualified_name)
            and torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, dispatch_key))


def _neo_kernel_origin(op: str, dispatch_key: str) -> str | None:
    """Where the kernel ``torch.ops.neo.<op>`` runs for ``dispatch_key`` was registered, as the
    dispatcher reports it (the file and line of the registration), or None without one."""
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"neo::{op}", dispatch_key):
        return None
    return repr(torch.library.get_kernel(f"neo::{op}", dispatch_key))


def _neo_kernel_state(op: str, dispatch_key: str) -> tuple[bool, str | None]:
    """(whether ``neo::<op>`` has a kernel of its own for ``dispatch_key``, the origin of the
    kernel it runs there)."""
    return _has_kernel(f"neo::{op}", dispatch_key), _neo_kernel_origin(op, dispatch_key)


def _record_neo_kernel(op: str, dispatch_key: str, name: str,
                       before: tuple[bool, str | None]) -> None:
    """Note that implementation ``name`` has just registered the kernel ``torch.ops.neo.<op>``
    runs for ``dispatch_key``; ``before`` is ``_neo_kernel_state`` from before the registration.
    Nothing is noted when nothing changed."""
    state = _neo_kernel_state(op, dispatch_key)
    if state == before:
        return
    origin = state[1]
    owners = _neo_kernels.setdefault((op, dispatch_key), {})
    if owners.get(origin, name) != name:
        raise RuntimeError(f"neo.ops cannot tell the {dispatch_key} kernels of neo::{op} by "
                           f"{owners[origin]} and {name} apart: both are {origin}")
    owners[origin] = name


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
        library.library("neo_reference").impl(op, function, "CompositeExplicitAutograd")
        before = {key: _neo_kernel_state(op, key) for key in DISPATCH_KEYS.values()}
        library.library("neo").impl(op, function, "CompositeExplicitAutograd")
        for key, state in before.items():
            _record_neo_kernel(op, key, "reference", state)
        _add("reference", op, tuple(DISPATCH_KEYS), True, native=False)


def _register_compiled(name: str, module: str, ops, dispatch_key: str, device: str) -> None:
    """Import the extension, which registers its kernels for ``neo_<name>`` and ``neo`` (noted
    as its own kernels of torch.ops.neo), declare ``neo_<name>``, and check that the kernels
    are there."""
    before = {op: _neo_kernel_state(op, dispatch_key) for op in ops}
    loaded, reason, path = _load_extension(module)
    if loaded:
        library.declare(f"neo_{name}", ops)
        _loaded_files[name] = path
    for op in ops:
        ok = loaded and _has_kernel(f"neo_{name}::{op}", dispatch_key)
        if loaded and not ok:
            reason = f"{module} has no {dispatch_key} kernel for {op}; rebuild the package"
        _add(name, op, (device,), ok, native=True, note="" if ok else reason)
        if loaded:
            _record_neo_kernel(op, dispatch_key, name, before[op])


def _register_numba() -> None:
    try:
        import numba  # noqa: F401
    except ImportError as error:
        for op in NUMBA_OPS:
            _add("numba", op, ("cpu",), False, native=False, note=f"numba is not installed ({error})")
        return
    from . import numba_kernels

    library.declare("neo_numba", NUMBA_OPS)
    for op in NUMBA_OPS:
        function = numba_kernels.IMPLEMENTATIONS[op]
        library.library("neo_numba").impl(op, function, "CPU")
        if not _has_kernel(f"neo::{op}", "CPU"):
            before = _neo_kernel_state(op, "CPU")
            _neo_fallback_library.impl(op, function, "CPU")
            _record_neo_kernel(op, "CPU", "numba", before)
        _add("numba", op, ("cpu",), True, native=False)


def _register_all() -> None:
    _register_reference()
    _register_compiled("cuda", "neo.ops._cuda_kernels", CUDA_OPS, "CUDA", "cuda")
    _register_compiled("ispc", "neo.ops._cpu_kernels", ISPC_OPS, "CPU", "cpu")
    _register_numba()


def _check_op(op: str) -> None:
    if op not in _implementations:
        raise ValueError(f"unknown neo op {op!r}; known ops: {', '.join(OP_NAMES)}")


def _dispatch_key(device: str) -> str:
    if device not in DISPATCH_KEYS:
        raise ValueError(f"unknown device {device!r}; neo kernels run on: {', '.join(DISPATCH_KEYS)}")
    return DISPATCH_KEYS[device]


def implementations(op: str, device: str | None = None,
                    available_only: bool = True) -> list[Implementation]:
    """Implementations of ``op``, optionally only those that run on ``device`` ('cpu'/'cuda')."""
    _check_op(op)
    if device is not None:
        _dispatch_key(device)
    return [impl for impl in _implementations[op]
            if (device is None or device in impl.devices) and (impl.available or not available_only)]


def register_kernel(op: str, name: str, function=None, *, device: str = "cpu") -> Implementation:
    """Add a kernel of ``op`` for ``device`` as the implementation ``name``, reachable as
    ``torch.ops.neo_<name>.<op>``, listed by ``implementations()`` and ``python -m neo.ops``, and
    selectable with ``select_implementation(op, device, name)``. Returns its ``Implementation``.

    - ``function`` given: a Python kernel, called with the op's arguments as its schema
      (``neo.ops.SCHEMAS``) names them, writing its out-parameters in place and returning None.
      ``neo_<name>::<op>`` is declared with that schema and its fake kernel, and ``function`` is
      registered for the device's dispatch key. Not native: it needs the interpreter.
    - ``function`` None: a compiled kernel. Its extension, already imported, registered it with
      ``TORCH_LIBRARY_IMPL(neo_<name>, CPU or CUDA, m) { m.impl("<op>", ...); }`` and left the
      declaration to neo.ops (as neo's own ISPC and CUDA extensions do); ``neo_<name>::<op>`` is
      declared here. Native.

    One name may serve several ops (one call per op). Registration leaves ``torch.ops.neo.<op>``
    as it is; callers that want the kernel select it by name. Raises ValueError for an unknown
    op or device, a name that is not an identifier, is ``"auto"`` or a built-in implementation's
    or already names an implementation of ``op``, an op already declared under ``neo_<name>``
    outside neo.ops, a compiled kernel that is missing, and a Python kernel where a kernel is
    already registered.
    """
    _check_op(op)
    dispatch_key = _dispatch_key(device)
    if not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"a kernel's name must be an identifier (it becomes the namespace "
                         f"neo_<name>), got {name!r}")
    if name == AUTO or name in BUILT_IN:
        raise ValueError(f"{name!r} is reserved (select_implementation's 'auto' and the built-in "
                         f"implementations {', '.join(BUILT_IN)}); choose another name")
    if any(impl.name == name for impl in _implementations[op]):
        raise ValueError(f"neo.{op} already has an implementation named {name!r}")
    qualified_name = f"neo_{name}::{op}"
    if library.is_declared(qualified_name):
        raise ValueError(f"{qualified_name} is already declared outside neo.ops; a kernel "
                         f"registers only its implementation and neo.ops declares the op")
    if function is None:
        if not _has_kernel(qualified_name, dispatch_key):
            raise ValueError(f"no compiled {dispatch_key} kernel is registered for "
                             f"{qualified_name}: import the extension that registers it "
                             f"(TORCH_LIBRARY_IMPL(neo_{name}, {dispatch_key}, m)) first, or "
                             f"pass the Python function")
    else:
        if not callable(function):
            raise ValueError(f"the kernel of {qualified_name} must be callable, got {function!r}")
        if torch._C._dispatch_has_kernel(qualified_name):
            raise ValueError(f"{qualified_name} already has a registered kernel; a compiled "
                             f"kernel is added with function=None")
    declaration = library.declare(f"neo_{name}", (op,))
    if function is not None:
        declaration.impl(op, function, dispatch_key)
    return _add(name, op, (device,), True, native=function is None)


def select_implementation(op: str, device: str, name: str = AUTO) -> Implementation:
    """The implementation of ``op`` named ``name`` that runs on ``device`` ('cpu'/'cuda').

    ``"auto"`` is the one ``torch.ops.neo.<op>`` runs there (``dispatched(op, device)``). An
    unknown or unavailable name is a ValueError listing the implementations available on the
    device, and why the named one is unavailable."""
    _check_op(op)
    _dispatch_key(device)
    wanted = dispatched(op, device) if name == AUTO else name
    serving = [impl for impl in _implementations[op] if device in impl.devices]
    available = ", ".join(impl.name for impl in serving if impl.available)
    for impl in serving:
        if impl.name == wanted:
            if impl.available:
                return impl
            raise ValueError(f"the {wanted} implementation of neo.{op} is unavailable: "
                             f"{impl.note}; available on {device}: {available}")
    elsewhere = [impl for impl in _implementations[op] if impl.name == wanted]
    runs_on = f" (it runs on {'/'.join(elsewhere[0].devices)})" if elsewhere else ""
    raise ValueError(f"neo.{op} has no implementation named {name!r} on {device}{runs_on}; "
                     f"available on {device}: {available}")


def build_fingerprints() -> dict[str, str]:
    """A digest of each loaded compiled extension's file, by implementation name ('cuda',
    'ispc'): anything measured with these kernels (a perf profile) is stale once they change.
    Read once per process (the code it describes is the one loaded). Kernels added with
    ``register_kernel`` have no file neo.ops knows of and are not included: whatever is measured
    with one has to name it."""
    return dict(_file_digests())


@functools.cache
def _file_digests() -> tuple[tuple[str, str], ...]:
    digests = []
    for name, path in sorted(_loaded_files.items()):
        with open(path, "rb") as file:
            digests.append((name, hashlib.sha256(file.read()).hexdigest()[:16]))
    return tuple(digests)


def ispc_bf16_decode_variant() -> str | None:
    """The variant the ISPC ``paged_decode_attention`` runs on bf16 caches now: ``"bf16_dot"``
    (the CPU's bf16 dot-product instruction) or ``"generic"``, as ``NEO_CPU_DECODE_ATTENTION_VARIANT``
    names it or, unset or ``auto``, the one that is the faster on this CPU (``bf16_dot`` on AMD
    CPUs with AVX512-BF16); None where the ISPC kernels were not built.
    A ValueError where the variable names no variant, or one the CPU cannot run."""
    if "ispc" not in _loaded_files:
        return None
    return importlib.import_module("neo.ops._cpu_kernels").bf16_decode_attention_variant()


def dispatched(op: str, device: str) -> str:
    """Name of the implementation ``torch.ops.neo.<op>`` runs for tensors on ``device``.

    Read from the dispatcher at every call: the kernel it holds for ``neo::<op>`` on the
    device's dispatch key (``torch.library.get_kernel``), matched by its origin (where it was
    registered, which the dispatcher keeps with each kernel) against the kernels neo.ops
    registered there itself: the reference (``CompositeExplicitAutograd``, which serves a key
    with no kernel of its own), the numba fallback, and those the compiled extensions registered
    while neo.ops imported them. A label kept from import time would go stale: any later
    registration for ``neo::<op>`` (from Python, or by another extension) replaces the kernel,
    and whether a key has a kernel does not say whose it is. The compiled extensions register
    their own ``neo::`` kernels, so neo.ops cannot be the only writer; it recognizes its own
    instead. A kernel it did not register is a RuntimeError naming the kernel's origin.
    """
    _check_op(op)
    dispatch_key = _dispatch_key(device)
    origin = _neo_kernel_origin(op, dispatch_key)
    name = _neo_kernels.get((op, dispatch_key), {}).get(origin) if origin else None
    if name is None:
        raise RuntimeError(f"torch.ops.neo.{op} runs a {dispatch_key} kernel that neo.ops did not "
                           f"register ({origin}); kernels are added with "
                           f"neo.ops.register_kernel, which leaves torch.ops.neo as it is")
    return name


_register_all()
