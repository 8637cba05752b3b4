"""The code's shape: imports point one way (memory <- pipeline <- cohorts <- reports <- deletion <- flows), at any
depth of a module (a function-level import counts); memory/ imports neither Polars nor Prefect; every public
function has type hints; no function but the compiled solver core's runs past 80 lines."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["memory", "pipeline", "cohorts", "reports", "deletion", "flows"]


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_every_import_points_down_the_layers():
    upward = [(f"{pkg}/{p.name}", m) for pkg in ORDER for p in sorted((ROOT / pkg).glob("*.py"))
              for m in _imports(p) if m.split(".")[0] in ORDER and ORDER.index(m.split(".")[0]) > ORDER.index(pkg)]
    assert upward == []


def test_memory_needs_no_data_frames_and_no_orchestrator():
    heavy = [(p.name, m) for p in sorted((ROOT / "memory").glob("*.py")) for m in _imports(p)
             if m.split(".")[0] in ("polars", "prefect", "duckdb")]
    assert heavy == []


def _functions(tree, public_only):
    """(qualified name, node) of module-level functions and methods of module-level classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not (public_only and node.name.startswith("_")):
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{f.name}", f


def _unannotated(fn, method):
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    if method and args and args[0].arg in ("self", "cls", "ctx"):
        args = args[1:]
    missing = [a.arg for a in args if a.annotation is None]
    if fn.returns is None and fn.name != "__init__":
        missing.append("return")
    return missing


def test_every_public_function_has_type_hints():
    missing = []
    for pkg in ORDER:
        for p in sorted((ROOT / pkg).glob("*.py")):
            for name, fn in _functions(ast.parse(p.read_text()), public_only=True):
                public = not fn.name.startswith("_") or fn.name == "__init__"
                if public and not name.split(".")[0].startswith("_") and (gaps := _unannotated(fn, "." in name)):
                    missing.append((f"{pkg}/{p.name}", name, gaps))
    assert missing == []


def test_no_function_outside_the_compiled_solver_core_runs_past_80_lines():
    # The compiled core's sweep stays one function: its loop carries a dozen locals (beta, the rates, the frozen
    # atoms, the error bound) from event to event, which a split would pass back and forth.
    long = [(f"{pkg}/{p.name}", node.name, node.end_lineno - node.lineno + 1)
            for pkg in [*ORDER, "bench"] for p in sorted((ROOT / pkg).glob("*.py"))
            if p.name != "solver_core.py"
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert long == []
