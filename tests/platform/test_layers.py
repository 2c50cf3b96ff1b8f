"""inference/ is arranged by the process that runs the code, and its imports only point down.

  core/      torch-free, shared by every process
  web/       the web tier            -> core
  dispatch/  a worker's main process -> core
  child/     a worker's pool child   -> core
  tasks.py   Celery's glue, where dispatcher and child meet -> anything

A back-arrow (core reaching up, or a child importing the web tier) or a circle between modules fails
here, naming the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "inference"
ROLES = ("core", "web", "dispatch", "child")
ALLOWED = {"core": {"core"}, "web": {"core", "web"}, "dispatch": {"core", "dispatch"}, "child": {"core", "child"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every inference import in the file, wherever it sits, except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("inference")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("inference"):
            # `from inference.core import gpu` imports the module inference.core.gpu
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                as_module = PACKAGE.parent / Path(*candidate.split("."))
                is_module = as_module.with_suffix(".py").exists() or (as_module / "__init__.py").exists()
                found.append((node.lineno, candidate if is_module else node.module))
    return found


def graph() -> dict[str, list[tuple[int, str]]]:
    return {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def role_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROLES else None


def test_each_role_folder_exists_and_says_what_runs_it() -> None:
    for role in ROLES:
        init = PACKAGE / role / "__init__.py"
        assert init.exists(), f"inference/{role}/ is missing"
        assert ast.get_docstring(ast.parse(init.read_text())), f"inference/{role}/__init__.py does not say what runs it"


def test_imports_point_only_down_to_core() -> None:
    wrong = []
    for module, imported in graph().items():
        role = role_of(module)
        if role is None:
            continue
        for line, target in imported:
            target_role = role_of(target)
            if target_role is None and target.startswith("inference.") and target != "inference":
                # the Django app's own modules (models, tasks) sit above the role folders
                if target.split(".")[1] in {"tasks"} or role != "web":
                    wrong.append(f"{module}:{line} imports {target}")
                continue
            if target_role and target_role not in ALLOWED[role]:
                wrong.append(f"{module}:{line} imports {target} ({role} -> {target_role})")
    assert not wrong, "back-arrows:\n" + "\n".join(wrong)


def test_no_import_circles() -> None:
    edges = {module: {target for _, target in imported} for module, imported in graph().items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in edges:
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _run_at_import(tree: ast.Module):
    """The nodes that run when the module is imported: everything but function bodies."""
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def test_core_and_web_never_import_torch() -> None:
    """The web tier must stay light: torch and transformers load only in worker children (a function in
    core/ may import torch when a child calls it)."""
    heavy = []
    for path in sorted((PACKAGE / "core").rglob("*.py")) + sorted((PACKAGE / "web").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _run_at_import(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            names = [n for n in names if n.split(".")[0] in {"torch", "transformers"}]
            if names:
                heavy.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {names[0]}")
    assert not heavy, "\n".join(heavy)
