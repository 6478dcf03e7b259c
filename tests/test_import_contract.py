"""The layers' import contract (DESIGN.md principle 6), read from the source with ``ast``.

- The serving core (config, request, model, engine, cluster, server, tokenizer, checkpoints,
  the length predictors ...) imports nothing of the harness (sim, planner, bench, flags, the
  CLIs, demo, predictor training) — at any level, ``TYPE_CHECKING`` blocks included.
- ``config`` and ``request`` import no other pdserve module but each other.
- No import cycle at import time (module-level imports), nor through function-level or
  ``TYPE_CHECKING`` imports.
- A function-level import of a pdserve module, core or harness, says why on its line
  (``# lazy: torch``, ...): it is there only to keep a heavy dependency from loading.

Each test names the offending import (file:line) so a failure says what to move.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdserve"

HARNESS = ("pdserve.sim", "pdserve.planner", "pdserve.bench", "pdserve.flags", "pdserve.cli",
           "pdserve.demo", "pdserve.predict.train")
LOWEST = ("pdserve.config", "pdserve.request")
# core -> harness edges kept on purpose, each with its reason
ALLOWED_BACK_EDGES = {
    ("pdserve.predict.data", "pdserve.bench.traces"):
        "a deployment may name a length trace as its predictor's training data",
}


@dataclass(frozen=True)
class Import:
    src: str  # importing module
    dst: str  # imported module
    where: str  # file:line
    level: str  # "top" (runs at import time), "function" or "typing" (TYPE_CHECKING)
    line: str  # the source line


def is_lowest(mod: str) -> bool:
    """``config`` (a package: its modules import each other) or ``request``."""
    return any(mod == m or mod.startswith(m + ".") for m in LOWEST)


def is_harness(mod: str) -> bool:
    return (any(mod == h or mod.startswith(h + ".") for h in HARNESS)
            or mod.endswith(".cli") or mod.endswith(".__main__"))


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _targets(node: ast.Import | ast.ImportFrom, pkg: str, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    # ``from pdserve.engine import policies`` imports the submodule
    subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
    return subs or [mod]


def scan(root: Path = PACKAGE) -> list[Import]:
    """Every import of a pdserve module inside the package under ``root``."""
    files = sorted(root.rglob("*.py"))
    top = root.parent
    modules = {module_name(p, top) for p in files}
    out: list[Import] = []
    for path in files:
        src = module_name(path, top)
        pkg = src if path.name == "__init__.py" else src.rpartition(".")[0]
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()

        def visit(node: ast.AST, level: str, path: Path = path, src: str = src,
                  pkg: str = pkg, lines: list[str] = lines) -> None:
            for child in ast.iter_child_nodes(node):
                lvl = level
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    lvl = "function" if level == "top" else level
                elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    lvl = "typing"
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for dst in _targets(child, pkg, modules):
                        if dst == "pdserve" or dst.startswith("pdserve."):
                            out.append(Import(src, dst, f"{path.relative_to(top)}:"
                                                        f"{child.lineno}", lvl,
                                              lines[child.lineno - 1]))
                visit(child, lvl)

        visit(ast.parse(text, str(path)), "top")
    return out


def back_edges(imports: list[Import]) -> list[str]:
    bad = []
    for i in imports:
        if not is_harness(i.src) and is_harness(i.dst) and \
                (i.src, i.dst) not in ALLOWED_BACK_EDGES:
            bad.append(f"{i.where}: core module {i.src} imports harness module {i.dst}")
        if is_lowest(i.src) and not is_lowest(i.dst):
            bad.append(f"{i.where}: {i.src} imports {i.dst} (config and request import no "
                       f"pdserve module above them)")
    return bad


def cycles(imports: list[Import], levels: tuple[str, ...] = ("top",)) -> list[list[str]]:
    """Strongly connected components (of more than one module, or a self-import) of the graph
    of the imports at ``levels`` (default: those that run at import time)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.level in levels:
            graph.setdefault(i.src, set()).add(i.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def unexplained_lazy_imports(imports: list[Import]) -> list[str]:
    return [f"{i.where}: function-level import of {i.dst} in {i.src} without a "
            f"'# lazy: <what it keeps from loading>' comment: import it at the top"
            for i in imports if i.level == "function" and "# lazy" not in i.line]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return scan()


def test_the_core_imports_nothing_of_the_harness(imports):
    assert back_edges(imports) == []


def test_no_import_cycle_at_import_time(imports):
    assert cycles(imports) == []


def test_no_import_cycle_even_through_lazy_and_typing_imports(imports):
    """Modules form layers: not even a function-level or a ``TYPE_CHECKING`` import closes a
    circle (a type a lower module needs lives there, or is a Protocol of what it reads)."""
    assert cycles(imports, ("top", "function", "typing")) == []


def test_function_level_imports_say_why(imports):
    assert unexplained_lazy_imports(imports) == []


def test_the_checks_catch_what_they_name(tmp_path):
    """A made-up package with a back-edge, a cycle and an unexplained lazy import: each check
    reports it (the checks above cannot pass by seeing nothing)."""
    pkg = tmp_path / "pdserve"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "sim").mkdir()
    for d in (pkg, pkg / "engine", pkg / "sim"):
        (d / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from pdserve.engine import policies\n")
    (pkg / "engine" / "policies.py").write_text(
        "from pdserve.engine.prefill_order import X\n"
        "def f():\n    from pdserve.sim.hardware import get_link\n")
    (pkg / "engine" / "prefill_order.py").write_text(
        "from pdserve.engine.policies import register\n"
        "def g():\n    import pdserve.request  # lazy: nothing, only a test\n")
    (pkg / "sim" / "hardware.py").write_text("from pdserve.config import Link\n")
    (pkg / "sim" / "target.py").write_text("def h():\n    from pdserve.sim.hardware import Link\n")
    found = scan(pkg)
    assert back_edges(found) == [
        "pdserve/config.py:1: pdserve.config imports pdserve.engine.policies (config and request "
        "import no pdserve module above them)",
        "pdserve/engine/policies.py:3: core module pdserve.engine.policies imports harness "
        "module pdserve.sim.hardware"]
    assert cycles(found) == [["pdserve.engine.policies", "pdserve.engine.prefill_order"]]
    assert sorted(cycles(found, ("top", "function", "typing"))) == [
        ["pdserve.config", "pdserve.engine.policies", "pdserve.engine.prefill_order",
         "pdserve.sim.hardware"]]
    assert unexplained_lazy_imports(found) == [
        "pdserve/engine/policies.py:3: function-level import of pdserve.sim.hardware in "
        "pdserve.engine.policies without a '# lazy: <what it keeps from loading>' comment: "
        "import it at the top",
        "pdserve/sim/target.py:2: function-level import of pdserve.sim.hardware in "
        "pdserve.sim.target without a '# lazy: <what it keeps from loading>' comment: import "
        "it at the top"]


def test_the_configs_name_tables_are_the_registries():
    """The configs validate names against tables of their own (they import nothing above
    them); each registry is filled with exactly its table's names."""
    from pdserve.cluster.flip import FLIP_POLICIES
    from pdserve.config import (
        ADMISSION_POLICIES,
        LENGTH_PREDICTORS,
        SCHEDULING_POLICIES,
    )
    from pdserve.config import (
        FLIP_POLICIES as FLIP_NAMES,
    )
    from pdserve.engine.admission import ADMISSIONS
    from pdserve.engine.policies import POLICIES
    from pdserve.predict import PREDICTORS

    assert sorted(POLICIES) == sorted(SCHEDULING_POLICIES)
    assert sorted(ADMISSIONS) == sorted(ADMISSION_POLICIES)
    assert sorted(FLIP_POLICIES) == sorted(FLIP_NAMES)
    assert ["none", *PREDICTORS] == list(LENGTH_PREDICTORS)
