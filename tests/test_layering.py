"""The code's shape: imports point one way (memory <- pipeline <- cohorts <- run <- reports <- deletion <- flows),
at any depth of a module (a function-level import counts); no two modules import each other in a circle; no
private name crosses a package; deletion takes the run from few modules; memory/ imports neither Polars nor
Prefect; every public function has type hints; no function but the compiled solver core's runs past 80 lines."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["memory", "pipeline", "cohorts", "run", "reports", "deletion", "flows"]


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_imports(path: Path):
    """(module, names) of every import of a project module by ``path``, relative ones resolved, at any depth
    (under ``if TYPE_CHECKING:`` and inside functions too)."""
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names = [a.name for a in node.names]
            if module.split(".")[0] in ORDER:
                # `from . import derived` imports a module, not a name
                subs = [n for n in names if (ROOT / module.replace(".", "/") / f"{n}.py").exists()]
                yield from ((f"{module}.{n}", []) for n in subs)
                if set(names) - set(subs):
                    yield module, [n for n in names if n not in subs]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names if a.name.split(".")[0] in ORDER)


def _project_files():
    return [p for pkg in ORDER for p in sorted((ROOT / pkg).glob("*.py"))]


def test_every_import_points_down_the_layers():
    upward = [(f"{pkg}/{p.name}", m) for pkg in ORDER for p in sorted((ROOT / pkg).glob("*.py"))
              for m in _imports(p) if m.split(".")[0] in ORDER and ORDER.index(m.split(".")[0]) > ORDER.index(pkg)]
    assert upward == []


def test_no_two_modules_import_each_other_in_a_circle():
    graph = {_module_of(p): {m for m, _ in _project_imports(p)} for p in _project_files()}
    circles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if n == m or n not in graph:
                continue
            if state.get(n) == "open":
                circles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_no_private_name_is_imported_from_another_package():
    private = [(str(p.relative_to(ROOT)), m, n) for p in _project_files() for m, names in _project_imports(p)
               for n in names if n.startswith("_") and m.split(".")[0] != p.parent.name]
    assert private == []


def test_deletion_takes_the_run_from_at_most_three_modules():
    """Outside the layers below the cohort (memory, pipeline) and the report's, deletion/ reads the run through
    few doors: its config, its evaluation and its cohort memory."""
    used = {m for p in sorted((ROOT / "deletion").glob("*.py")) for m, _ in _project_imports(p)
            if m.split(".")[0] in ("cohorts", "run")}
    assert len(used) <= 3, sorted(used)


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


# Functions whose signature is an interface of its own: the scheduled run's parameters are the deployment's (a
# prefect.yaml names each, one per RunParams field, and a flow's parameters are its signature).
SIGNATURE_IS_AN_INTERFACE = {("flows/prefect_flows.py", "scheduled_run")}


def _compiled(node) -> bool:
    """A numba kernel (@njit): its arguments are the solver's array buffers, passed positionally (a kernel takes
    no keyword record of Python objects), and the sweep's loop carries a dozen locals from event to event, which a
    split would pass back and forth."""
    return any("njit" in ast.unparse(d) for d in node.decorator_list)


def test_no_function_runs_past_60_lines_or_takes_more_than_8_parameters_outside_the_compiled_kernels():
    found = []
    for pkg in [*ORDER, "bench"]:
        for p in sorted((ROOT / pkg).glob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _compiled(node):
                    continue
                a = node.args
                params = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
                lines = node.end_lineno - node.lineno + 1
                if (lines > 60 or len(params) > 8) and (f"{pkg}/{p.name}", node.name) not in SIGNATURE_IS_AN_INTERFACE:
                    found.append((f"{pkg}/{p.name}", node.name, lines, len(params)))
    assert found == []


def test_only_the_project_s_own_error_types_mean_your_input():
    """A builtin KeyError or ValueError raised by our code is a defect (exit 1), never "your input" (exit 2): every
    error class a package defines as input, refusal or environment derives from pipeline.errors (the SV memory's
    own input errors aside), so no bare builtin is taken for the user's."""
    from flows.failures import failure_status
    from pipeline.errors import ForgetfulError
    assert [failure_status(e) for e in (KeyError("k"), ValueError("v"), TypeError("t"), RuntimeError("r"))] == \
        [1, 1, 1, 1]
    builtin_bases = {"ValueError", "KeyError", "RuntimeError", "Exception"}
    loose = []
    for pkg in ("pipeline", "cohorts", "run", "reports", "deletion", "flows"):
        for p in sorted((ROOT / pkg).glob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Locked", "Failed", "Stopped")):
                    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    if bases and bases <= builtin_bases and node.name != ForgetfulError.__name__:
                        loose.append(f"{pkg}/{p.name}: {node.name}({', '.join(sorted(bases))})")
    assert loose == []
