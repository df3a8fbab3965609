"""The package's shape: imports run one way, so a module can be read (and tested) without the ones
built on it."""

import ast
import io
import re
import tokenize
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


# Each package's layer: a module imports its own package and lower layers only, so the kernels (array
# primitives, as torch's ops are) and the core are the ground floors, and the policies and `--budget
# auto` (one layer) never know each other.
LAYERS = {
    "dyspec.errors": 0,
    "dyspec.defaults": 0,
    "dyspec.cache": 0,
    "dyspec.figures": 0,  # draws plain data, imports nothing of dyspec
    "dyspec.kernels": 1,
    "dyspec.core": 2,
    "dyspec.forward": 3,
    "dyspec.drafts": 4,
    "dyspec.load": 5,
    "dyspec.policies": 6,
    "dyspec.auto": 6,
    "dyspec.decode": 7,
    "dyspec.export": 8,
    "dyspec.eval": 9,
    "dyspec.train": 10,
    "dyspec.views": 10,
    "dyspec.cli": 11,
    "dyspec.__main__": 12,
    "dyspec": 12,  # re-exports the public names
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
    assert "dyspec.figures" in leaves


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


def source_files() -> list[Path]:
    """The package, the web app and the notebook widgets."""
    root = PACKAGE.parent
    return [*sorted(PACKAGE.rglob("*.py")), root / "app.py", *sorted((root / "widgets").glob("*.py"))]


# a number with a unit of time, speed or size, a percentage, or a measured ratio ("1.16x", "3x as")
MEASURED = re.compile(
    r"\d[\d.,]*\s*(?:ms|us|µs|s|seconds|minutes|GB/s|MB/s|tokens/s|MB|GB)\b|\d%|\d\.\d+x\b|\d+x (?:as|faster|slower)"
)
NOT_MEASURED = re.compile(r"95% (?:bootstrap )?interval")  # a confidence level names a method, not a result


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return found


def test_docstrings_and_comments_state_rules_not_measurements():
    """A measurement changes with every bench and machine: it lives in docs/results and the guides,
    and a comment keeps the rule and its reason."""
    hits = [
        f"{path.name}:{line}: {text.strip()}"
        for path in source_files()
        for line, text in comments_and_docstrings(path)
        if MEASURED.search(NOT_MEASURED.sub("", text))
    ]
    assert not hits, "\n".join(hits)
    assert MEASURED.search("a forward went from 4.8 to 1.5 ms") and MEASURED.search("made 1.16x `ar`")


def test_fast_path_names_are_read_in_one_place():
    """The forward is an object chosen once (dyspec.forward.choose); nothing else compares a fast
    path's name."""
    names = {"off", "lean", "static", "compiled"}
    hits = [
        f"{path.name}:{node.lineno}"
        for path in source_files()
        if path != PACKAGE / "forward" / "choose.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        and any(isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators])
        or isinstance(node, ast.Compare)
        and any(
            isinstance(c, ast.Tuple) and any(isinstance(e, ast.Constant) and e.value in names for e in c.elts)
            for c in node.comparators
        )
    ]
    assert not hits, hits


def test_no_state_is_kept_on_a_model():
    """Forwards, caches and graphs belong to the objects that run a model, never to `model.__dict__`."""
    hits = [f"{path.name}" for path in source_files() if "__dict__" in path.read_text()]
    assert not hits, hits


def test_functions_are_short():
    """A function over 80 lines does several jobs: the package's, the web app's and the widgets'
    split where they do (checks apart from work, a plan apart from running it, layout by tab)."""
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in source_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 >= 80
    ]
    assert not long, long
