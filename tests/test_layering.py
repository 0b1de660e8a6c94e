"""The package graph runs one way, and no module uses another's private names.

Layers, lowest first (a module may import its own layer and the layers below it):

    formats, implementation -> numerics, hadamard, plan -> native -> qarray -> io -> recipes
      -> bits -> operand, calibrate, gptq -> pallas_kernels (the kernels and their references)
      -> dot_general, ragged -> flax -> ptq -> autoquant -> experiments -> benchmarks

``lowbit`` reaches ``pallas_kernels`` only through the lazy implementation table in
``lowbit.gemm.implementation`` (an ``importlib`` call on first use, no import statement), and
``pallas_kernels`` imports only lowbit modules below ``dot_general`` (never the ``lowbit``
package itself, whose ``__init__`` loads ``dot_general``). ``lowbit/__init__.py`` re-exports
the public API and is exempt. Everything is read from the source with ``ast``: nothing here
depends on what happens to be imported already.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lowbit", "pallas_kernels", "experiments", "benchmarks")

LAYERS = [
    ("lowbit.core", "lowbit.gemm", "lowbit.core.formats", "lowbit.gemm.implementation"),
    ("lowbit.core.numerics", "lowbit.core.hadamard", "lowbit.core.plan", "lowbit.core.scales"),
    ("lowbit.core.native",),
    ("lowbit.core.qarray", "lowbit.core.requantize"),
    ("lowbit.io",),
    ("lowbit.gemm.recipes",),
    ("lowbit.bits",),
    ("lowbit.gemm.operand", "lowbit.calibrate", "lowbit.gptq"),
    ("lowbit.gemm.grouped",),
    ("pallas_kernels",),
    ("lowbit.gemm.dot_general", "lowbit.gemm.ragged"),
    ("lowbit.flax",),
    ("lowbit.ptq",),
    ("lowbit.autoquant",),
    ("experiments",),
    ("benchmarks",),
]


def layer(module: str) -> int | None:
    """The layer of a module (the longest matching prefix), None for third-party modules."""
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, rank = len(name), i
    return rank


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


MODULES = modules()


def _resolve(node: ast.ImportFrom, module: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, path: Path):
    """(imported module, name or None, line) for every import statement of a file, with
    ``from pkg import sub`` resolved to the submodule when ``pkg.sub`` is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(node, module, path)
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno
                else:
                    yield src, alias.name, node.lineno


def test_the_layer_table_covers_every_module():
    missing = [m for m in MODULES if m != "lowbit" and layer(m) is None]
    assert not missing, f"modules without a layer in LAYERS: {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_layers(module):
    if module == "lowbit":  # the package's public re-exports
        return
    path, own = MODULES[module], layer(module)
    bad = []
    for target, _, line in imports(module, path):
        rank = layer(target)
        if rank is None:
            continue
        if target == "lowbit" and own < layer("lowbit.gemm.dot_general"):
            bad.append(f"line {line}: imports the lowbit package (loads dot_general and more)")
        elif rank > own:
            bad.append(f"line {line}: imports {target} (layer {rank} > {own})")
        if module.startswith("lowbit") and target.startswith("pallas_kernels"):
            bad.append(f"line {line}: lowbit imports {target} (use the implementation table)")
    assert not bad, f"{module}:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_of_other_modules(module):
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    ours = {m for m in MODULES}
    bad = []
    aliases: dict[str, str] = {}  # local name -> one of our modules
    for target, name, line in imports(module, path):
        if not (target in ours or target.split(".")[0] in PACKAGES):
            continue
        if name is not None and name.startswith("_") and target != module:
            bad.append(f"line {line}: from {target} import {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ours:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(node, module, path)
            for a in node.names:
                if f"{src}.{a.name}" in ours:
                    aliases[a.asname or a.name] = f"{src}.{a.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and aliases[node.value.id] != module
        ):
            bad.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert not bad, f"{module} uses private names of other modules:\n" + "\n".join(bad)


def test_lowbit_reaches_the_kernels_through_one_table():
    import importlib

    impl = importlib.import_module("lowbit.gemm.implementation")
    for name, (mod, attr) in impl.KERNELS.items():
        # an implementation's name ("pallas"), or its name and an op ("pallas_grouped")
        assert name.partition("_")[0] in impl.IMPLEMENTATIONS
        assert mod in MODULES and layer(mod) == layer("pallas_kernels")
        assert callable(getattr(importlib.import_module(mod), attr))
    # and that table is the only place lowbit names a kernel module as a string (what an
    # importlib call would take), docstrings aside
    for module, path in MODULES.items():
        if not module.startswith("lowbit") or module == "lowbit.gemm.implementation":
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr)}
        names = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                 and isinstance(n.value, str) and id(n) not in docs
                 and n.value.startswith("pallas_kernels")]
        assert not names, f"{module} names {names}"


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports, by any import statement (those inside
    functions included: ``imports`` walks the whole tree); an import of a name resolves to
    the module that defines it (the longest of our modules that prefixes it)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _, _ in imports(module, path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_import_graph_has_no_cycle():
    """No two modules import each other, directly or through others, not even inside a
    function (where the layer test above cannot see the cycle: both may sit in one layer)."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The size rules of the layout: no file in lowbit/, pallas_kernels/ or experiments/ over 800
# lines; no function anywhere over 100 lines except the Pallas kernel bodies named here.
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 100
LONG_KERNEL_BODIES = {"pallas_kernels.quantize.kernel._quantize"}


def test_no_file_over_800_lines():
    long = [f"{m} ({n} lines)" for m, path in MODULES.items()
            if m.split(".")[0] in ("lowbit", "pallas_kernels", "experiments")
            and (n := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_over_100_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and f"{module}.{node.name}" not in LONG_KERNEL_BODIES:
                    long.append(f"{module}.{node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
