"""The package's import layout (docs/architecture.md, "Package layout"): every module
imports alone, the import graph has no circle, and no module takes another module's
private name.

The graph is read from the sources with ``ast``: imports inside functions count as much
as those at the top of a module, since a circle hidden in a function is still a circle.
``NUMA_MOE_LAYOUT_ROOT`` points the checks at another checkout's ``numa_moe``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("NUMA_MOE_LAYOUT_ROOT") or Path(__file__).resolve().parents[1])
PACKAGE = ROOT / "numa_moe"
# compiled extension modules: private by name, built to be imported by the package
EXTENSIONS = {"numa_moe._native", "numa_moe._native_bench", "numa_moe._bench"}
# The floors of docs/architecture.md, bottom up: a module imports its own floor or lower.
FLOORS = ("numa_moe.placement", "numa_moe.checkpoints", "numa_moe.layer", "numa_moe.integrations",
          "numa_moe.apps")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def resolve(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]):
    """(imported module, names taken from it, line) for every numa_moe import in a
    module's source, at any depth. ``from pkg import mod`` counts as an import of
    pkg.mod, and of pkg itself only when a name that is not a module is taken."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "numa_moe" or alias.name.startswith("numa_moe."):
                    yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node, module, path)
            if source != "numa_moe" and not source.startswith("numa_moe."):
                continue
            names = []
            for alias in node.names:
                child = f"{source}.{alias.name}"
                if child in modules or child in EXTENSIONS:
                    yield child, (), node.lineno
                else:
                    names.append(alias.name)
            if names:
                yield source, tuple(names), node.lineno


def private_attributes(module: str, path: Path, modules: dict[str, Path]):
    """(line, name, module) for every ``alias._name`` read where alias is a numa_moe
    module this one imported (``from numa_moe.x import mod as alias``, ``import
    numa_moe.x as alias``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names
                            if a.asname and a.name.startswith("numa_moe.")})
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node, module, path)
            for a in node.names:
                child = f"{source}.{a.name}"
                if child in modules:
                    aliases[a.asname or a.name] = child
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and aliases[node.value.id] != module
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield node.lineno, node.attr, aliases[node.value.id]


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    graph = {}
    for module, path in modules.items():
        graph[module] = {target for target, _, _ in imports_of(module, path, modules)
                         if target in modules and target != module}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per tangle of the graph (per strongly connected component of more than
    one module, or a module importing itself), each as [a, b, ..., a]."""
    circles, seen = [], set()
    while True:
        rest = {n: {t for t in targets if t not in seen} for n, targets in graph.items() if n not in seen}
        circle = find_circle(rest)
        if circle is None:
            return circles
        circles.append(circle)
        # everything that reaches the circle and is reached from it is the same tangle
        tangle = set(circle)
        grew = True
        while grew:
            grew = False
            for node, targets in rest.items():
                if node not in tangle and targets & tangle and _reaches(rest, tangle, node):
                    tangle.add(node)
                    grew = True
        seen |= tangle


def _reaches(graph: dict[str, set[str]], goal: set[str], start: str) -> bool:
    """Whether start is reached from goal (a path from a goal module to start)."""
    stack, visited = list(goal), set(goal)
    while stack:
        for target in graph.get(stack.pop(), ()):
            if target == start:
                return True
            if target not in visited:
                visited.add(target)
                stack.append(target)
    return False


def test_finds_a_circle_and_names_it():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    two = {"a": {"b"}, "b": {"a", "c"}, "c": {"b"}, "x": {"y"}, "y": {"x"}, "z": {"a"}}
    assert find_circles(two) == [["a", "b", "a"], ["x", "y", "x"]]


def test_reads_function_level_and_relative_imports(tmp_path):
    source = ("import os\nfrom numa_moe import low\n\ndef f():\n    from numa_moe.low import helper\n"
              "    from . import sibling\n    from .sibling import _hidden\n")
    path = tmp_path / "numa_moe" / "pkg" / "mod.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    modules = {"numa_moe.low": None, "numa_moe.pkg.sibling": None}
    found = sorted(imports_of("numa_moe.pkg.mod", path, modules))
    assert found == [("numa_moe.low", (), 2), ("numa_moe.low", ("helper",), 5),
                     ("numa_moe.pkg.sibling", (), 6), ("numa_moe.pkg.sibling", ("_hidden",), 7)]


def test_no_import_circle():
    circles = find_circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def floor_of(module: str) -> int:
    """0 for the bottom (the package's own top-level modules), else 1 + the index of the
    subpackage in FLOORS."""
    for i, prefix in enumerate(FLOORS):
        if module == prefix or module.startswith(prefix + "."):
            return i + 1
    return 0


def test_floors_only_look_down():
    if not (PACKAGE / "layer").is_dir():
        pytest.skip(f"{PACKAGE} has no floors")
    modules = package_modules()
    upward = []
    for module, path in modules.items():
        if module == "numa_moe":  # the package's lazy names reach up by design
            continue
        for target, _, line in imports_of(module, path, modules):
            if floor_of(target) > floor_of(module):
                upward.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}")
    assert not upward, "imports up a floor:\n" + "\n".join(upward)


def test_no_private_name_from_another_module():
    modules = package_modules()
    crossings = []
    for module, path in modules.items():
        for target, names, line in imports_of(module, path, modules):
            if target == module:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if target not in EXTENSIONS and target.rsplit(".", 1)[-1].startswith("_"):
                private.append(target)
            crossings += [f"{path.relative_to(ROOT)}:{line}: {name} from {target}" for name in private]
        for line, name, target in private_attributes(module, path, modules):
            crossings.append(f"{path.relative_to(ROOT)}:{line}: {name} of {target}")
    assert not crossings, "private names used outside their module:\n" + "\n".join(crossings)


def test_every_module_imports_alone():
    """Each module in a fresh interpreter of its own, so that no module only works
    because another one was imported first."""
    modules = sorted(package_modules())
    script = ("import importlib, sys\nfrom pathlib import Path\nname, root = sys.argv[1], Path(sys.argv[2])\n"
              "try:\n    module = importlib.import_module(name)\n"
              "except Exception as error:\n    print(f'{name}: {type(error).__name__}: {error}')\n"
              "    sys.exit(1)\n"
              "if root not in Path(module.__file__).resolve().parents:\n"
              "    print(f'{name}: imported from {module.__file__}, not from {root}')\n    sys.exit(1)\n")
    # the child finds the package as this interpreter did (same flags, this tree first)
    flags = (["-S"] if sys.flags.no_site else []) + (["-P"] if sys.flags.safe_path else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    failures = []
    for name in modules:
        done = subprocess.run([sys.executable, *flags, "-c", script, name, str(ROOT.resolve())], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            failures.append((done.stdout + done.stderr).strip().splitlines()[-1])
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
