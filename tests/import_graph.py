"""kvviz's import graph read from the source (every import: module level, in functions and under
TYPE_CHECKING), for the layering test and docs/architecture.md."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvviz"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the kvviz module imported (a package's __init__ is the package's name)
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports() -> list[Import]:
    """Every kvviz import of every kvviz module; `from P import x` names P.x when x is a module."""
    known = modules()
    found = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            found += [Import(name, t, node.lineno) for t in dict.fromkeys(targets) if t in known and t != name]
    return found


def layer(module: str) -> str:
    """The package directly under kvviz a module belongs to; a module of the root is its own layer
    ('errors', '__main__'), and the root package itself is 'kvviz'."""
    return module.split(".")[1] if "." in module else module
