"""The package's shape, as CONTRIBUTING states it: family folders behind faces that only import and
name, size limits a reader can hold, one public home per name, and the renamed constant's warning."""

from __future__ import annotations

import ast
import inspect
import pydoc
import types
import warnings
from pathlib import Path

import pytest

import rlfleet.placement

PKG = Path(rlfleet.placement.__file__).parent
FOLDERS = ("cost", "topology", "place", "reshard", "sync", "schedule", "paper")
MODULES = sorted(PKG.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _all(path: Path) -> list[str]:
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_the_folders_are_the_families_and_none_is_crowded() -> None:
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(FOLDERS)
    for folder in FOLDERS:
        modules = [p for p in (PKG / folder).glob("*.py") if p.name != "__init__.py"]
        assert 1 <= len(modules) <= 10, folder
    root = [p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__about__.py")]
    assert len(root) <= 6, root


@pytest.mark.parametrize("face", [PKG / "__init__.py", *(PKG / f / "__init__.py" for f in FOLDERS)])
def test_every_face_only_imports_and_names(face: Path) -> None:
    body = _tree(face).body
    docstring = bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    for node in body[int(docstring) :]:
        targets = [getattr(t, "id", "") for t in node.targets] if isinstance(node, ast.Assign) else []
        names_all = targets == ["__all__"]
        assert isinstance(node, (ast.Import, ast.ImportFrom)) or names_all, f"{face}:{node.lineno}"
    if face.parent != PKG:
        assert len(_all(face)) <= 30, face


def test_modules_and_functions_stay_short() -> None:
    for path in MODULES:
        assert len(path.read_text().splitlines()) <= 500, path
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert (node.end_lineno or node.lineno) - node.lineno + 1 <= 80, f"{path}: {node.name}"


def test_no_underscore_name_is_imported_from_another_module() -> None:
    for path in MODULES:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlfleet"):
                names = [a.name for a in node.names]
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                assert not private, f"{path}: {private} from {node.module}"


def test_the_root_exports_each_folders_names_as_the_same_objects_under_its_own_name() -> None:
    root = rlfleet.placement
    for folder in FOLDERS:
        face = getattr(root, folder)
        for name in face.__all__:
            assert getattr(root, name) is getattr(face, name), f"{folder}.{name}"
            assert name in root.__all__, name
    for name in root.__all__:
        obj = getattr(root, name)
        # help() and tracebacks name the root; a type alias such as `tuple[...]` has no module of
        # its own (Python 3.10 counts it as a type)
        is_class = isinstance(obj, type) and not isinstance(obj, types.GenericAlias)
        if is_class or inspect.isfunction(obj):
            assert obj.__module__ == "rlfleet.placement", name
    assert "plan_sync" in rlfleet.placement.plan_sync.__qualname__


def test_the_renamed_seed_strategies_warn_and_name_the_new_name() -> None:
    with pytest.warns(DeprecationWarning, match="SEED_BUFFER_STRATEGIES"):
        from rlfleet.placement import WEIGHT_BUFFER_STRATEGIES
    assert WEIGHT_BUFFER_STRATEGIES == rlfleet.placement.SEED_BUFFER_STRATEGIES
    assert rlfleet.placement.SEED_BUFFER_STRATEGIES == ("None", "Double", "Shared")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rlfleet.placement.SEED_BUFFER_STRATEGIES  # the new name is quiet
    with pytest.raises(AttributeError, match="no attribute 'NOPE'"):
        _ = rlfleet.placement.NOPE  # type: ignore[attr-defined]


def test_help_names_the_import_users_write_not_a_private_module() -> None:
    for obj in (rlfleet.placement.plan_sync, rlfleet.placement.SyncPlan, rlfleet.placement.fit_cost_model):
        first = pydoc.render_doc(obj, renderer=pydoc.plaintext).splitlines()[0]
        assert first.endswith(f"{obj.__name__} in module rlfleet.placement"), first
