"""One import package: an install adds the top-level name `tenax` and no generic one.

The repository's role folders (`orchestrator/`, `workers/`, `checkpoint/`, `parallel/`) install
under `tenax` through setup.py's `package_dir`; a folder that is a package but is missing from
the wheel would import in the editable install and fail in a real one, so the wheel is built
and read here.
"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROLES = ("orchestrator", "workers", "checkpoint", "parallel")


def test_generic_names_do_not_import_outside_the_repository(tmp_path: Path) -> None:
    script = ("import importlib, sys\n"
              "import tenax.checkpoint, tenax.orchestrator, tenax.parallel, tenax.workers\n"
              "import tenax.proto\n"
              "for name in ('checkpoint', 'orchestrator', 'parallel', 'workers'):\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "    except ModuleNotFoundError:\n"
              "        continue\n"
              "    sys.exit(f'{name} imports as a top-level module')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_the_wheel_holds_every_package_under_tenax_only(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = tmp_path.glob("tenax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tenax"}, tops
    packages = {str(p.parent.relative_to(REPO)) for role in ROLES
                for p in (REPO / role).rglob("__init__.py")}
    missing = sorted(p for p in packages if f"tenax/{p}/__init__.py" not in names)
    assert missing == [], f"packages missing from the wheel: {missing}"
    assert "tenax/v1/jobs_pb2.py" in names and "tenax/v1/jobs.proto" in names
    # a stale module in a build directory (one a rename left behind) must not ride along
    extra = sorted(n for n in names if n.endswith(".py") and not source_of(n).is_file())
    assert extra == [], (f"modules in the wheel with no source file: {extra} (setuptools "
                         "copies what an earlier build left in build/: remove it)")


def source_of(name: str) -> Path:
    """The file in the repository a wheel member `tenax/...` was built from (setup.py's
    package_dir: each role folder and proto/tenax/v1 sit under `tenax`)."""
    parts = name.split("/")[1:]
    if parts and parts[0] in ROLES:
        return REPO.joinpath(*parts)
    if parts and parts[0] == "v1":
        return REPO.joinpath("proto", "tenax", *parts)
    return REPO.joinpath("tenax", *parts)
