"""Imports run one way: entry points -> search/eval -> engine/draft -> kernels -> assets -> model -> errors.

A module may import its own package and any package below it, never one above (the ``selfspec`` facade and the
``python -m`` shims aside).
"""

import ast
from pathlib import Path

from tests import helpers

ROOT = helpers.ROOT / "selfspec"
LEVEL = {"errors": 0, "typed": 0, "locks": 0, "model": 1, "assets": 2, "kernels": 3, "engine": 4, "draft": 4,
         "provenance": 4, "search": 5, "eval": 5, "cli": 6, "inspect": 6, "generate": 6, "tables": 6}
LIMIT = 400  # lines a module may have (C++ aside)


def _package(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("selfspec"):
            out += [node.module] if node.module != "selfspec" else [f"selfspec.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("selfspec")]
    return out


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        if rel.name == "__main__" or rel.parts == ("selfspec", "__init__"):
            continue  # the `python -m` shims and the facade
        yield ".".join(rel.parts), path


def test_every_package_has_a_level():
    assert {_package(name) for name, _ in _modules()} <= set(LEVEL)


def test_no_import_runs_back_up():
    upward = [f"{name} imports {target}" for name, path in _modules() for target in _imports(path)
              if _package(target) != _package(name) and LEVEL.get(_package(target), 99) > LEVEL[_package(name)]]
    assert not upward, "\n".join(upward)


def test_no_module_is_over_the_limit():
    long = [f"{name}: {n} lines" for name, path in _modules()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > LIMIT]
    assert not long, "\n".join(long)
