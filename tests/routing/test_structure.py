"""The package's shape (issue 23): small modules and functions, faces that only re-export, no
private name crossing modules, and public names that say they live in `rlfleet.routing`."""

from __future__ import annotations

import ast
import inspect
import pydoc
from pathlib import Path

import pytest

import rlfleet.routing

SRC = Path(rlfleet.routing.__file__).parent
MODULES = sorted(SRC.glob("*.py"))
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_package_is_where_the_tests_look() -> None:
    assert {p.name for p in MODULES} >= {"__init__.py", "_base.py", "_worker.py"}


def test_no_underscore_name_is_imported_from_another_module() -> None:
    crossing = [
        f"{path.name}:{node.lineno} imports {alias.name} from {node.module}"
        for path in MODULES
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and alias.name != "__version__"
    ]
    assert crossing == []


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for path in MODULES:
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.name}:{node.lineno} {node.name}(): {length} lines")
    assert too_long == []


def test_the_face_only_imports_and_sets_all() -> None:
    body = _tree(SRC / "__init__.py").body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the module docstring
    other = [
        f"line {node.lineno}: {type(node).__name__}"
        for node in body
        if not isinstance(node, (ast.Import, ast.ImportFrom))
        and not (
            isinstance(node, ast.Assign)
            and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"]
        )
    ]
    assert other == []


def _public_objects() -> list[tuple[str, object]]:
    return [
        (name, obj)
        for name in rlfleet.routing.__all__
        if inspect.isclass(obj := getattr(rlfleet.routing, name)) or inspect.isfunction(obj)
    ]


@pytest.mark.parametrize(("name", "obj"), _public_objects(), ids=[n for n, _ in _public_objects()])
def test_public_names_live_in_rlfleet_routing(name: str, obj: object) -> None:
    home = getattr(obj, "__module__", None)
    assert home == "rlfleet.routing", f"{name} says it lives in {home}"
    assert "in module rlfleet.routing\n" in pydoc.plain(pydoc.render_doc(obj))
