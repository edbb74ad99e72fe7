"""What an install gets: one import name, `mfsreg`, with every module of the source folders under it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# source folder -> where setup.py puts it in the package
FOLDERS = {
    "mfsreg": "mfsreg",
    "registry": "mfsreg/registry",
    "api": "mfsreg/api",
    "cli": "mfsreg/cli",
    "migrations": "mfsreg/migrations",
}


def _sources() -> list[Path]:
    """The repository's files a build sees: tracked ones and new ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [Path(p) for p in out.split("\0") if p and (REPO / p).exists()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of the sources (a build writes build/ and *.egg-info beside them)."""
    src = tmp_path_factory.mktemp("src")
    for rel in _sources():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("mfsreg-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_the_wheel_installs_one_import_name(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist() if ".dist-info/" not in name}
    assert tops == {"mfsreg"}
    (top_level,) = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")] or [None]
    if top_level:
        assert wheel.read(top_level).decode().split() == ["mfsreg"]


def test_every_source_module_and_migration_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    wanted = {
        FOLDERS[p.parts[0]] + "/" + "/".join(p.parts[1:])
        for p in _sources()
        if p.parts[0] in FOLDERS and p.suffix in (".py", ".mako", ".html", ".css", ".js", ".svg")
    }
    assert wanted and wanted <= names, sorted(wanted - names)
    built = {n.split(".")[0] for n in names if n.endswith(".so")}
    assert built == {
        "mfsreg/registry/format/_grouping",
        "mfsreg/registry/format/_busguard",
        "mfsreg/registry/client/_mapfiles",
    }


def test_the_console_script_and_version(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "mfsreg = mfsreg.cli.main:entry" in wheel.read(entry_points).decode()
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    import mfsreg

    assert f"\nVersion: {mfsreg.__version__}\n" in wheel.read(metadata).decode()


def test_no_module_imports_the_folders_by_their_bare_names():
    """Imported as `registry.x` beside `mfsreg.registry.x`, a module would load twice, with two
    copies of every class (an error raised by one is not caught as the other's)."""
    bare = {"registry", "api", "cli", "migrations"}
    found = []
    for path in _sources():
        if path.suffix != ".py" or path.parts[0] not in {*FOLDERS, "tests", "benchmarks", "examples"}:
            continue
        for node in ast.walk(ast.parse((REPO / path).read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [f"{path}:{node.lineno} {n}" for n in names if n.split(".")[0] in bare]
    assert found == []


def test_the_python_api_is_importable_from_the_package_root():
    import mfsreg

    assert {"Registry", "RemoteRegistry", "load_tensors", "ResidentModel", "Settings"} <= set(dir(mfsreg))
    assert mfsreg.Registry.__module__ == "mfsreg.registry.registry"
    assert mfsreg.RemoteRegistry.__module__ == "mfsreg.registry.client.remote"
    with pytest.raises(AttributeError):
        mfsreg.no_such_name  # noqa: B018
