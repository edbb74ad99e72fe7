"""The arrows of the architecture: the core imports no web or CLI framework, the node client needs
no database driver, and no module imports itself round a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def modules_after(imports: str) -> set[str]:
    code = f"import sys; {imports}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return {m.split(".")[0] for m in out.split()}


def test_core_imports_no_framework():
    loaded = modules_after(
        "import mfsreg.registry.registry, mfsreg.registry.store.service, mfsreg.registry.auth, mfsreg.registry.store.stats"
    )
    assert "fastapi" not in loaded and "typer" not in loaded and "starlette" not in loaded


def test_node_client_needs_no_database_driver():
    loaded = modules_after(
        "import mfsreg.registry.client.remote, mfsreg.registry.client.fetch, mfsreg.registry.client.cache, "
        "mfsreg.registry.client.node, mfsreg.registry.client.warm"
    )
    assert "sqlalchemy" not in loaded and "psycopg" not in loaded and "alembic" not in loaded
    assert "torch" not in loaded  # load_tensors and ResidentModel bring torch only when used
    assert "pydantic" not in loaded  # the wire documents' models load at a client's first check


# -- no import cycles ---------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"mfsreg": "mfsreg", "registry": "mfsreg.registry", "api": "mfsreg.api", "cli": "mfsreg.cli"}


def _modules() -> dict[str, Path]:
    """Every module of the package by its import name (migrations run under Alembic, apart)."""
    out = {}
    for folder, name in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            out[".".join([name, *parts[:-1]] if parts[-1] == "__init__" else [name, *parts])] = path
    return out


def _runtime_imports(tree: ast.Module, package_init: bool = False):
    """Every import statement, at module level or inside a function, but those under ``if
    TYPE_CHECKING:`` (annotations only: they never run). Of a package's __init__, the module-level
    ones alone: importing any module of the package runs those, while a name its ``__getattr__``
    (or a function) loads on first use is imported by whoever uses it."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        if package_init and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            skipped.update(id(n) for n in ast.walk(node))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped]


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, its own package's __init__ among them. ``from
    pkg import name`` is an import of ``pkg.name`` where that is a module (a C extension is a
    leaf), else of ``pkg``."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in _runtime_imports(ast.parse(path.read_text()), path.name == "__init__.py"):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                named = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                    for a in node.names
                    if not (base in mods and (mods[base].parent / f"{a.name}.c").exists())  # a C extension
                ]
            for target in named:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target in mods and target != mod and target.startswith("mfsreg"):
                    deps.add(target)
        graph[mod] = deps
    # Importing a.b.c runs the package a.b's __init__ first: an edge to it, but from a module that
    # __init__ itself imports (re-exports), which Python has running already by then.
    for mod in mods:
        parent = mod.rpartition(".")[0]
        if parent in mods and mod not in graph[parent]:
            graph[mod].add(parent)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_cycle():
    graph = import_graph()
    assert len(graph) > 100 and "mfsreg.registry.client._mapfiles" not in graph
    assert "mfsreg.registry.blobs.urls" in graph["mfsreg.registry.config"]  # the walk sees imports
    assert "mfsreg.registry.store.ingest" in graph["mfsreg.registry.registry"]  # ... inside functions too
    found = cycles(graph)
    edges = {m: sorted(graph[m] & set(c)) for c in found for m in c}
    assert not found, f"import cycles: {found}; the imports inside them: {edges}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# -- the CLI talks to a registry through its interface -----------------------------------------

# The implementations of registry/interface.RegistryClient, and the store's own modules
IMPLEMENTATIONS = {"mfsreg.registry.registry", "mfsreg.registry.client.remote", "mfsreg.registry.store.service"}
# cli/backend.py opens one or the other (open_backend, server_client, embedded); cli/server.py runs
# `serve` and `token`, and cli/admin.py `db upgrade`, on the database itself
OPENERS = {"mfsreg.cli.backend", "mfsreg.cli.server", "mfsreg.cli.admin"}


STORE_SIDE = ("mfsreg.registry.store", "mfsreg.registry.db")  # what only a registry (or its openers) touches


def test_cli_commands_reach_a_registry_through_its_interface_only():
    graph = import_graph()

    def behind(deps: set[str]) -> list[str]:
        return sorted(d for d in deps if d in IMPLEMENTATIONS or d.startswith(STORE_SIDE))

    reaching = {
        mod: behind(deps)
        for mod, deps in graph.items()
        if mod.startswith("mfsreg.cli") and mod not in OPENERS and behind(deps)
    }
    assert not reaching, f"open a registry through cli/backend.py, not directly: {reaching}"
    assert graph["mfsreg.cli.backend"] & IMPLEMENTATIONS  # (the test looks where the imports are)


# -- names ----------------------------------------------------------------------------------------


def same_names(modules) -> dict[str, list[str]]:
    """Module names (the last part) that more than one of ``modules`` (import names) has."""
    by_name: dict[str, list[str]] = {}
    for mod in modules:
        by_name.setdefault(mod.rsplit(".", 1)[-1], []).append(mod)
    return {name: sorted(mods) for name, mods in by_name.items() if len(mods) > 1}


def test_no_two_modules_of_the_core_share_a_name():
    """registry/ by role: a db module is named apart from the store module it serves (reclaim for
    prune), a client module apart from a blob store's (embedded, not a second local)."""
    core = [m for m, path in _modules().items() if m.startswith("mfsreg.registry.") and path.name != "__init__.py"]
    assert not same_names(core), f"name these apart: {same_names(core)}"
    assert same_names(["a.b.tags", "a.c.tags", "a.d.x"]) == {"tags": ["a.b.tags", "a.c.tags"]}


# -- one push --------------------------------------------------------------------------------------


def calls_to(source: str, name: str) -> list[int]:
    """Lines where ``source`` calls ``name`` (a bare name or an attribute of that name)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name)
    ]


def test_a_push_is_driven_in_one_place():
    """The sequence of a push (cut and hash, then negotiate, upload, commit) lies in pushing.drive:
    no other module starts a HashJob but hashing's own hash_source, and both registries' push call drive."""
    modules = _modules()
    starting = {
        mod: lines
        for mod, path in modules.items()
        if mod not in ("mfsreg.registry.pushing", "mfsreg.registry.format.hashing")
        and (lines := calls_to(path.read_text(), "HashJob"))
    }
    assert not starting, f"a push's steps run in mfsreg.registry.pushing.drive only: {starting}"
    assert calls_to(modules["mfsreg.registry.pushing"].read_text(), "HashJob")
    for mod in ("mfsreg.registry.store.ingest", "mfsreg.registry.client.remote"):
        assert calls_to(modules[mod].read_text(), "drive"), f"{mod}'s push does not call pushing.drive"
    # the store answers the embedded push (ingest.LocalPush) and the server (service) with one step each
    ingest, service = (modules[f"mfsreg.registry.store.{m}"].read_text() for m in ("ingest", "service"))
    for step in ("negotiate_step", "store_chunks", "commit_step"):
        assert calls_to(service, step), f"the server's side of the push does not call ingest.{step}"
        assert calls_to(ingest, step), f"the embedded push does not call ingest.{step}"
    for step in ("survey", "plan_push", "commit_version"):  # inside those steps only
        assert not calls_to(service, step), f"the server calls ingest.{step} beside the shared steps"


def test_the_push_rule_finds_a_second_driver():
    assert calls_to("with HashJob(source, 1, p) as job:\n    pass\n", "HashJob") == [1]
    assert calls_to("x = pushing.drive(steps, path)\n", "drive") == [1]
    assert calls_to("from mfsreg.registry.format.hashing import HashJob\n", "HashJob") == []


# -- functions short enough to read ---------------------------------------------------------------

LONGEST = 60  # lines, the def and its docstring included


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of the functions over LONGEST lines without a comment, right after their
    docstring, that says why they read better whole: one starting "# (over 60 lines: "."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        first = node.body[0]
        after = (
            first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else node.lineno
        )
        said = after < len(lines) and lines[after].strip().startswith(f"# (over {LONGEST} lines: ")
        if length > LONGEST and not said:
            out.append((node.name, length))
    return out


def test_functions_over_60_lines_say_why():
    found = [
        f"{path.relative_to(REPO)}: {name} ({n} lines)"
        for path in _modules().values()
        for name, n in long_functions(path.read_text())
    ]
    assert not found, "split these, or say why one reads better whole: " + "; ".join(found)


def test_the_length_rule_finds_a_long_function_and_takes_a_reason():
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST))
    plain = f'def f():\n    """Doc."""\n{body}\n'
    assert long_functions(plain) == [("f", LONGEST + 2)]
    said = f'def f():\n    """Doc."""\n    # (over {LONGEST} lines: one list)\n{body}\n'
    assert long_functions(said) == []
    assert long_functions(f"def f():\n{body[body.index(chr(10)) + 1 :]}\n") == []  # 60 lines exactly
