"""The package imports downward only (DESIGN.md, "floors"), and has no import cycle.

Every first-party import of every module is read with ``ast`` (top level AND inside functions,
so a lazy import cannot hide an upward edge), mapped to its floor, and checked:
an import may point to the same floor or below, never above; and the module graph is acyclic.
An import inside a function must say why on its line (a ``# lazy:`` comment): only the CLI
has them, so that a command's heavy modules (torch) load when that command is chosen and
``multitoken --help`` stays fast. (The command table itself imports by name, with importlib.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("base", "embedded", "kernels", "adapters", "stats", "decoding", "pipeline")

# Module-name prefix -> floor, bottom up (longest prefix wins).
FLOORS = {
    "multitoken.base": 0,
    "multitoken.embedded": 0,  # data package: paths of the shipped model, heads, stats
    "multitoken.kernels": 1,  # CPU linears on the weights' own codes: a library of their own
    "multitoken.adapters": 1,
    "multitoken.stats": 1,
    "multitoken.decoding": 2,
    "multitoken.pipeline.model": 3,
    "multitoken.pipeline.runtime": 3,  # the decoding step's runtime beside the model it steps
    "multitoken.pipeline.sources": 3,  # where a model comes from: fetch, llama2.c, the shipped assets
    "multitoken.pipeline.train": 4,
    "multitoken.pipeline.eval": 4,
    "multitoken.pipeline.integrations": 4,  # our heads inside transformers' generate
    "multitoken.pipeline.cli": 5,
    "multitoken.pipeline": 5,  # the package __init__: lazy re-exports of every floor
}


def floor(module: str) -> int:
    prefix = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[prefix]


def modules() -> dict[str, Path]:
    found = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if "embedded" in parts and path.name != "__init__.py":
                continue
            name = ".".join(("multitoken",) + parts).removesuffix(".__init__")
            found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, bool, str]]:
    """(imported module, line, inside a function, source line) for each first-party import."""
    tree = ast.parse(path.read_text(), str(path))
    lines = path.read_text().splitlines()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import submodule` points at the submodule
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            if target.startswith("multitoken.") and target != name:
                out.append((target, node.lineno, id(node) in in_function, lines[node.lineno - 1]))
    return out


MODULES = modules()
GRAPH = {name: imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def test_the_walk_sees_every_package():
    assert {"multitoken.base.errors", "multitoken.adapters.registry", "multitoken.stats.table",
            "multitoken.decoding.engine", "multitoken.pipeline.model.model", "multitoken.pipeline.cli"} <= set(MODULES)
    assert sum(len(edges) for edges in GRAPH.values()) > 100  # the walk finds imports at all


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    up = [f"line {line}: {target} (floor {floor(target)} > {floor(name)})"
          for target, line, _, _ in GRAPH[name] if floor(target) > floor(name)]
    assert not up, f"{name} imports upward: " + "; ".join(up)


# Outside the CLI, a module may import lazily only to keep an optional extra optional.
OPTIONAL_EXTRA_LAZY = {"multitoken.decoding.dynamo.step"}  # numba kernels ([fast] extra)


def test_lazy_imports_only_in_the_cli():
    lazy = {name for name in MODULES for _, _, inside, _ in GRAPH[name] if inside}
    outside = sorted(name for name in lazy if not name.startswith("multitoken.pipeline.cli") and name not in OPTIONAL_EXTRA_LAZY)
    assert lazy and not outside, outside


def test_base_imports_only_base():
    for name in MODULES:
        if floor(name) == 0:
            above = [t for t, *_ in GRAPH[name] if floor(t) != 0]
            assert not above, f"{name} (base) imports {above}"


def test_in_function_imports_say_why():
    for name in MODULES:
        hidden = [f"{name}:{line}" for target, line, inside, source in GRAPH[name]
                  if inside and "# lazy:" not in source]
        assert not hidden, f"first-party import inside a function without a `# lazy:` reason: {hidden}"


def test_no_import_cycle():
    edges = {name: sorted({t for t, *_ in GRAPH[name] if t in MODULES}) for name in MODULES}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node, stack):
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])


def import_chain(package: str) -> tuple[str, ...]:
    """The longest chain of module-level imports among ``package``'s modules (the package
    itself included: importing it runs its ``__init__``)."""
    inside = {m for m in MODULES if m == package or m.startswith(package + ".")}
    edges = {m: sorted({t for t, _, lazy, _ in GRAPH[m] if t in inside and not lazy}) for m in inside}
    longest: dict[str, tuple[str, ...]] = {}

    def walk(m: str) -> tuple[str, ...]:
        if m not in longest:
            longest[m] = max(((m,) + walk(n) for n in edges[m]), key=len, default=(m,))
        return longest[m]
    return max((walk(m) for m in inside), key=len)


def test_decoding_imports_stay_shallow():
    """One engine over a few narrow pieces: no chain of imports inside decoding/ is longer than
    five modules (the package, the engine, a proposer, DynaMo's step, the config)."""
    chain = import_chain("multitoken.decoding")
    assert len(chain) <= 5, " -> ".join(chain)
    files = [p for p in (REPO / "decoding").rglob("*.py")]
    assert len(files) <= 20, sorted(str(p.relative_to(REPO)) for p in files)


def test_the_checker_catches_an_upward_import():
    assert floor("multitoken.pipeline.model.backbone") > floor("multitoken.decoding.engine")
    assert floor("multitoken.base.errors") < floor("multitoken.adapters.registry")
    assert floor("multitoken.pipeline") == floor("multitoken.pipeline.cli")


def test_the_bottom_floor_loads_no_floor_above():
    """Importing the base (and the data package) runs no higher floor's package: they install
    under their own names (pyproject's package-dir), not under multitoken.pipeline."""
    code = ("import sys, multitoken.base.errors, multitoken.base.atomic, multitoken.embedded; "
            "print(sorted(m for m in sys.modules if m.startswith('multitoken.') and m.split('.')[1] not in ('base', 'embedded')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
