"""The package's shape: imports run one way, so a module can be read (and tested) without the ones
built on it."""

import ast
from pathlib import Path

import dyspec

PACKAGE = Path(dyspec.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """Module -> the dyspec modules it imports, at any level of its code (an import inside a function
    counts), and the packages above them (importing dyspec.a.b runs dyspec/a/__init__.py first) but
    its own (they are running when it runs); the top package, which re-exports the public names, is
    left out."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dyspec"):
                names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names if a.name.startswith("dyspec")}
        parents = {".".join(n.split(".")[:i]) for n in names for i in range(2, n.count(".") + 1)}
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        graph[name] = {n for n in names | parents if n in modules and n not in own}
    return graph


def test_no_import_cycles():
    graph, done, cycles = import_graph(), set(), []

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph[module]):
            if dep in path:
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in done:
                visit(dep, [*path, dep])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    assert "dyspec.decode.engine" in graph and "dyspec.policies" in graph["dyspec.decode.engine"]
    assert not cycles, cycles


def test_the_core_imports_no_front_end():
    """The engine knows nothing of the views, the bench or training."""
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith(("dyspec.core", "dyspec.policies", "dyspec.auto")):
            outside = {d for d in deps if d.startswith(("dyspec.views", "dyspec.eval", "dyspec.train", "dyspec.cli"))}
            assert not outside, (module, outside)


# Each package's layer: a module imports its own package and lower layers only, so the core is a
# ground floor and the policies and `--budget auto` (one layer) never know each other.
LAYERS = {
    "dyspec.errors": 0,
    "dyspec.defaults": 0,
    "dyspec.core": 1,
    "dyspec.models": 2,
    "dyspec.policies": 3,
    "dyspec.auto": 3,
    "dyspec.decode": 4,
    "dyspec.export": 5,
    "dyspec.eval": 6,
    "dyspec.train": 7,
    "dyspec.views": 7,
    "dyspec.cli": 8,
    "dyspec.__main__": 9,
    "dyspec": 9,  # re-exports the public names
}


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_layers_run_one_way():
    """Package by package: imports go down the layers or stay in the package, except to a leaf (a
    module that imports nothing of dyspec, like the figures, which any layer may draw with)."""
    graph = import_graph()
    leaves = {m for m, deps in graph.items() if not deps}
    assert set(map(package, graph)) == set(LAYERS), "every package has a layer"
    wrong = [
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps - leaves
        if package(dep) != package(module) and LAYERS[package(dep)] >= LAYERS[package(module)]
    ]
    assert not wrong, wrong
    assert "dyspec.views.figures" in leaves


def functions(folder: str) -> list[tuple[str, ast.FunctionDef]]:
    """(file name, function) for every function defined in a package folder, methods included."""
    return [
        (path.name, node)
        for path in sorted((PACKAGE / folder).glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
    ]


def test_auto_functions_take_few_parameters():
    """`--budget auto`'s parts hand records between them (a plan, how a tree was built), not long
    argument lists; `self` counts."""
    many = [
        f"{name}:{f.name}"
        for name, f in functions("auto")
        if len(f.args.posonlyargs + f.args.args + f.args.kwonlyargs) > 6
    ]
    assert not many, many


def test_commands_are_thin():
    """Each command parses, calls the library and prints: no function of the command line over 60
    lines."""
    long = [f"{name}:{f.name}" for name, f in functions("cli") if f.end_lineno - f.lineno + 1 > 60]
    assert not long, long
