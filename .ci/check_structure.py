"""The folder and face rules import-linter cannot express, checked on the package sources.

- a folder under ``packages/<pkg>/src/rlfleet/<pkg>/`` holds at most 10 modules, a package root
  at most 6 besides its face (routing is exempt: one family, flat);
- every ``__init__.py`` only imports and sets ``__all__`` (a docstring allowed); a subpackage
  face exports at most 30 names, weightsync's root at most 155;
- no underscore name is imported from another module, and no module imports another
  package's private module;
- modules at most 500 lines, functions at most 80;
- ``policygroup.worker`` and ``policygroup.nemo`` import no ray at module level;
- weightsync holds no policy-worker surface (``*Calls`` classes, ``WorkerHost``, ``Checkpoints``,
  ``reference_logprobs``).

Run from the repository root: ``python .ci/check_structure.py``; exits 1 naming every breach.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("routing", "placement", "weightsync", "policygroup")
FOLDER_LIMIT, ROOT_LIMIT = 10, 6
FACE_LIMIT, ROOT_FACE_LIMITS = 30, {"weightsync": 155}
MODULE_LINES, FUNCTION_LINES = 500, 80
RAY_FREE = (("policygroup", "worker"), ("policygroup", "nemo"))
WORKER_SURFACE = {"WorkerHost", "Checkpoints", "reference_logprobs"}


def modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__about__.py"))


def face_breaches(path: Path, tree: ast.Module, limit: int) -> list[str]:
    out: list[str] = []
    names: list[str] = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "__all__"
        ):
            names = list(ast.literal_eval(node.value))
            continue
        out.append(f"{path}:{node.lineno}: a face only imports and sets __all__ ({type(node).__name__})")
    if len(names) > limit:
        out.append(f"{path}: the face exports {len(names)} names (limit {limit})")
    return out


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def import_breaches(path: Path, tree: ast.Module, pkg: str) -> list[str]:
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            ours = node.module.split(".")[0] == "rlfleet"
            for alias in node.names:
                if ours and private(alias.name):
                    out.append(f"{path}:{node.lineno}: imports {alias.name} (private) from {node.module}")
            targets = [node.module]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            foreign = parts[0] == "rlfleet" and len(parts) > 1 and parts[1] != pkg
            if foreign and any(private(p) for p in parts[2:]):
                out.append(f"{path}:{node.lineno}: imports {target}, another package's private module")
    return out


def size_breaches(path: Path, source: str, tree: ast.Module) -> list[str]:
    out: list[str] = []
    lines = len(source.splitlines())
    if lines > MODULE_LINES:
        out.append(f"{path}: {lines} lines (limit {MODULE_LINES})")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > FUNCTION_LINES:
                out.append(f"{path}:{node.lineno}: {node.name} is {length} lines (limit {FUNCTION_LINES})")
    return out


def ray_at_module_level(path: Path, tree: ast.Module) -> list[str]:
    out: list[str] = []
    for node in tree.body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(n == "ray" or n.startswith("ray.") for n in names):
            out.append(f"{path}:{node.lineno}: imports ray at module level (this folder is Ray-free)")
    return out


def worker_surface(path: Path, tree: ast.Module) -> list[str]:
    out: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            continue
        if node.name in WORKER_SURFACE or (isinstance(node, ast.ClassDef) and node.name.endswith("Calls")):
            out.append(f"{path}:{node.lineno}: {node.name} is a policy worker's surface (policygroup's)")
    return out


def check_package(pkg: str) -> list[str]:
    base = ROOT / "packages" / pkg / "src" / "rlfleet" / pkg
    out: list[str] = []
    if pkg != "routing" and len(modules(base)) > ROOT_LIMIT:
        out.append(f"{base}: {len(modules(base))} modules at the package root (limit {ROOT_LIMIT})")
    for folder in sorted(p for p in base.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        if len(modules(folder)) > FOLDER_LIMIT:
            out.append(f"{folder}: {len(modules(folder))} modules (limit {FOLDER_LIMIT})")
    for path in sorted(base.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py":
            limit = ROOT_FACE_LIMITS.get(pkg, 10**6) if path.parent == base else FACE_LIMIT
            out += face_breaches(rel, tree, limit)
        out += import_breaches(rel, tree, pkg)
        out += size_breaches(rel, source, tree)
        folder = path.relative_to(base).parts[0] if len(path.relative_to(base).parts) > 1 else ""
        if (pkg, folder) in RAY_FREE:
            out += ray_at_module_level(rel, tree)
        if pkg == "weightsync":
            out += worker_surface(rel, tree)
    return out


def main() -> int:
    breaches = [b for pkg in PACKAGES for b in check_package(pkg)]
    for breach in breaches:
        print(breach)
    print(f"structure: {len(breaches)} breach(es) in {', '.join(PACKAGES)}")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
