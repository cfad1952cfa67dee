"""The layout docs/architecture.md describes is the one the source has: each package imports only
what its row of the table allows, nothing imports itself back, and any module can be imported first."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.import_graph import ROOT, Import, imports, layer, modules

DOC = ROOT.parent / "docs" / "architecture.md"
EVERYONE = {"kvviz", "errors", "util"}  # the version, the error root and the helpers


def rule() -> dict[str, set[str]]:
    """The table's rows: package -> the packages it may import."""
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\| *([\w, ]*?) *\|$", DOC.read_text(), re.M)
    return {pkg: {p.strip() for p in allowed.split(",") if p.strip()} for pkg, allowed in rows}


def violations(found: list[Import]) -> list[str]:
    allowed = {pkg: deps | EVERYONE for pkg, deps in rule().items()}
    allowed |= {"kvviz": set(), "errors": set(), "util": {"errors"}, "__main__": {"cli"}}
    return [f"{i.source}:{i.line} imports {i.target}" for i in found
            if layer(i.source) != layer(i.target) and layer(i.target) not in allowed[layer(i.source)]]


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (its nodes in order, the first repeated last), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_every_package_has_a_row_and_the_root_keeps_only_init_main_and_errors():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(rule())
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py", "__main__.py", "errors.py"]


def test_the_table_has_no_cycle():
    assert cycle(rule()) == []


def test_every_import_follows_the_table():
    assert violations(imports()) == []


def test_no_module_imports_itself_back():
    graph: dict[str, set[str]] = {}
    for i in imports():
        graph.setdefault(i.source, set()).add(i.target)
    assert cycle(graph) == []


def test_the_checks_see_a_wrong_import_and_a_cycle():
    """Each check above fires on what it forbids: the engine importing the store (the old layout's
    engine -> workload -> engine is the cycle)."""
    assert violations([Import("kvviz.engine.loop", "kvviz.store.run_store", 3)]) == [
        "kvviz.engine.loop:3 imports kvviz.store.run_store"]
    assert violations([Import("kvviz.util.ids", "kvviz.engine", 1)]) != []
    assert violations([Import("kvviz.ui.home", "kvviz.analysis.runs", 1)]) == []
    old = {"kvviz.workload": {"kvviz.engine"}, "kvviz.engine": {"kvviz.engine.engine"},
           "kvviz.engine.engine": {"kvviz.workload"}}
    assert cycle(old) == ["kvviz.engine", "kvviz.engine.engine", "kvviz.workload", "kvviz.engine"]


@pytest.mark.slow
def test_any_module_can_be_imported_first():
    names = [m for m in modules() if not m.startswith("kvviz.ui.pages") and m != "kvviz.__main__"]
    out = subprocess.run([sys.executable, "-m", "tests.import_first", *names], capture_output=True, text=True,
                         timeout=280, cwd=ROOT.parent)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
