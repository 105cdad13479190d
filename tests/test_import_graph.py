"""The keras_tpu package has no import cycles (beyond a shrinking list of known ones).

Every module of the package is parsed with ``ast`` (nothing is imported) and
every import of a keras_tpu module is an edge, whether it is at module level
or inside a function: a function-local import hides a cycle from Python's
import machinery but not from the design. A package's implicit import of its
parent packages is not an edge (importing ``keras_tpu.mxu._cost`` runs
``keras_tpu/__init__.py``, which imports everything; that is not a cycle of
the design).

``KNOWN_CYCLES_TO_REMOVE`` lists the cycles that exist today and are to be
removed. The test fails on any cycle not listed (a new one), and on any
listed cycle that no longer exists (so remove it from the list).
"""

import ast
import os

PACKAGE = "keras_tpu"
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

# Each cycle as the tuple of its modules, starting at the alphabetically first,
# in import order (a imports b imports ... imports a). Empty this set.
# (profile <-> tpu_model, listed when this test was written, was removed by commit fffe3aa.)
KNOWN_CYCLES_TO_REMOVE = set()


def package_modules():
    """``{module name: source path}`` for every module of the package."""
    modules = {}
    for root, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(root, name), os.path.dirname(PACKAGE_DIR))
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = os.path.join(root, name)
    return modules


def _resolve(name, modules):
    """The module that importing ``name`` runs last: ``name`` itself if it is a module."""
    return name if name in modules else None


def _parsed(path):
    """The module's syntax tree, and whether it is a package's ``__init__``."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path), os.path.basename(path) == "__init__.py"


def _from_source(module, node, is_package):
    """The absolute name of the module a ``from ... import`` statement in ``module`` imports from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(module, path, modules):
    """The keras_tpu modules ``module`` imports anywhere in its source."""
    tree, is_package = _parsed(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            source = _from_source(module, node, is_package)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                # `from keras_tpu.mxu import _cost as cost` imports the submodule; `from keras_tpu.mxu import route`
                # imports the package keras_tpu.mxu.
                target = _resolve(f"{source}.{alias.name}", modules) or _resolve(source, modules)
                if target:
                    found.add(target)
    found.discard(module)
    return found


def import_graph():
    modules = package_modules()
    return {module: imported_modules(module, path, modules) for module, path in modules.items()}


def elementary_cycles(graph):
    """Every simple cycle, each as a tuple starting at its smallest module (one DFS per start node)."""
    cycles = set()
    nodes = sorted(graph)
    for start in nodes:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    cycles.add(tuple(path))
                elif nxt > start and nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return cycles


def format_cycle(cycle):
    return " -> ".join(cycle + (cycle[0],))


def test_the_graph_sees_module_level_and_local_imports():
    graph = import_graph()
    assert "keras_tpu.mxu._numerics" in graph["keras_tpu.mxu._primitives"]      # module level
    assert "keras_tpu.mxu._routing" in graph["keras_tpu._export"]                # inside a function
    assert "keras_tpu.mxu" in graph["keras_tpu"]                               # `from keras_tpu import mxu`


def test_cycle_finder_on_a_toy_graph():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"d"}}
    assert elementary_cycles(graph) == {("a", "b"), ("a", "b", "c"), ("d",)}


def test_no_new_import_cycles_and_no_stale_known_ones():
    cycles = elementary_cycles(import_graph())
    new = sorted(cycles - KNOWN_CYCLES_TO_REMOVE)
    gone = sorted(KNOWN_CYCLES_TO_REMOVE - cycles)
    message = []
    if new:
        message.append("Import cycles in keras_tpu (module-level or function-local imports):\n  "
                       + "\n  ".join(format_cycle(c) for c in new))
    if gone:
        message.append("These cycles no longer exist; remove them from KNOWN_CYCLES_TO_REMOVE:\n  "
                       + "\n  ".join(format_cycle(c) for c in gone))
    assert not message, "\n".join(message)


def private_name_reads(module, path, modules):
    """``(line, "module._name")`` for each private name of another keras_tpu module this module reads.

    Two forms are seen: ``from keras_tpu.x import _name`` and ``alias._name`` where ``alias`` was bound
    to a keras_tpu module by an import. A private *module* (``keras_tpu._files``) may be imported;
    the names it keeps private may not be read from outside it.
    """
    tree, is_package = _parsed(path)
    aliases, reads = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _from_source(module, node, is_package)
            if source not in modules:
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and source != module:
                    reads.append((node.lineno, full))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{aliases[node.value.id]}.{node.attr}" not in modules
                and aliases[node.value.id] != module):
            reads.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return sorted(reads)


def test_the_private_name_finder_sees_both_forms(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from keras_tpu import _pod as pod\nfrom keras_tpu._cores import _secret, CoreLayout\n"
                      "pod._started\npod.barrier\n")
    modules = {"keras_tpu": "", "keras_tpu._pod": "", "keras_tpu._cores": "", "keras_tpu.m": str(source)}
    assert private_name_reads("keras_tpu.m", str(source), modules) == [
        (2, "keras_tpu._cores._secret"), (3, "keras_tpu._pod._started")]


def test_no_module_reads_another_modules_private_names():
    modules = package_modules()
    found = [f"{module} line {line}: {name}" for module, path in sorted(modules.items())
             for line, name in private_name_reads(module, path, modules)]
    assert not found, "Modules reading another module's private names:\n  " + "\n  ".join(found)
