"""The arrows of the architecture: the core imports no web or CLI framework, and the node client
needs no database driver."""

from __future__ import annotations

import subprocess
import sys


def modules_after(imports: str) -> set[str]:
    code = f"import sys; {imports}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return {m.split(".")[0] for m in out.split()}


def test_core_imports_no_framework():
    loaded = modules_after(
        "import mfsreg.registry.registry, mfsreg.registry.service, mfsreg.registry.auth, mfsreg.registry.stats"
    )
    assert "fastapi" not in loaded and "typer" not in loaded and "starlette" not in loaded


def test_node_client_needs_no_database_driver():
    loaded = modules_after(
        "import mfsreg.registry.client.remote, mfsreg.registry.client.fetch, mfsreg.registry.client.cache, "
        "mfsreg.registry.client.node, mfsreg.registry.client.warm"
    )
    assert "sqlalchemy" not in loaded and "psycopg" not in loaded and "alembic" not in loaded
    assert "torch" not in loaded  # load_tensors and ResidentModel bring torch only when used
