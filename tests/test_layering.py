"""Imports point one way (memory <- pipeline <- cohorts <- reports <- deletion <- flows), at any depth of a
module (a function-level import counts), and memory/ imports neither Polars nor Prefect."""
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
