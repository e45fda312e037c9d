"""The layout: the import graph of ``neo`` (``neo/``, ``models/`` as ``neo.models``, ``ops/`` as
``neo.ops``) has no cycle, and dependencies point one way::

    front door (neo, neo.llm, neo.cli, neo.server, neo.bench)
      -> neo.engine -> neo.runner -> neo.sched -> neo.kv
      -> shared types (neo.config, neo.request, neo.sampling_params, neo.outputs, neo.tokenizer,
         neo.incremental_text)
      -> neo.models -> neo.ops

Imports inside functions count: a lazy import is still a dependency.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_FOLDERS = {"neo": "neo", "models": "neo.models", "ops": "neo.ops"}
LAYERS = [  # lowest first; a module may import its own layer and those below it
    ("ops", ("neo.ops",)),
    ("models", ("neo.models",)),
    ("shared types", ("neo.config", "neo.request", "neo.sampling_params", "neo.outputs", "neo.tokenizer",
                      "neo.incremental_text")),
    ("kv", ("neo.kv",)),
    ("sched", ("neo.sched",)),
    ("runner", ("neo.runner",)),
    ("engine", ("neo.engine",)),
    ("front door", ("neo", "neo.llm", "neo.cli", "neo.server", "neo.bench")),
]


def source_modules() -> dict[str, str]:
    """Dotted module name -> file."""
    modules = {}
    for folder, prefix in SOURCE_FOLDERS.items():
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    parts = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    modules[".".join([prefix] + parts)] = path
    return modules


MODULES = source_modules()


def imported(module: str, path: str) -> set[str]:
    """The neo modules ``module`` imports, at any depth of its code."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            submodules = {f"{target}.{alias.name}" for alias in node.names} & set(MODULES)
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in the module itself
                found.add(target)
    return {target for target in found if target in MODULES and target != module}


GRAPH = {module: imported(module, path) for module, path in MODULES.items()}


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix that names ``module``'s layer."""
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} belongs to no layer"
    return max(matches)[1]


def test_every_module_is_found():
    assert {"neo.engine.engine", "neo.sched.scheduler", "neo.runner.executor", "neo.kv.kv_cache",
            "neo.models.llama", "neo.ops.registry"} <= set(MODULES)


def test_the_import_graph_has_no_cycle():
    index, lowlink, on_stack, stack, cycles = {}, {}, set(), [], []

    def connect(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = lowlink[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in GRAPH[module]:
            if target not in index:
                connect(target)
                lowlink[module] = min(lowlink[module], lowlink[target])
            elif target in on_stack:
                lowlink[module] = min(lowlink[module], index[target])
        if lowlink[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            connect(module)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_dependencies_point_down(module):
    own = layer_of(module)
    upward = sorted(target for target in GRAPH[module] if layer_of(target) > own)
    assert not upward, (f"{module} ({LAYERS[own][0]}) imports {upward} from a layer above it "
                        f"({', '.join(LAYERS[layer_of(target)][0] for target in upward)})")


def test_models_import_nothing_from_the_engine():
    for module in MODULES:
        if module.startswith("neo.models"):
            assert all(target.startswith(("neo.models", "neo.ops")) for target in GRAPH[module]), module
