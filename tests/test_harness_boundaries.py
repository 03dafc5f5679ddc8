"""The test suite and the benchmarks share one harness, `tenax.testing`, and not each other.

Nothing under `bench/` imports `tests`, nothing under `tests/` imports `bench` (what both need
lives in `tenax.testing`); the package's layers never import `tenax.testing`, and it never
imports pytest (the benchmarks run without it). A bench script run as a path says how to run
it and exits 2, instead of failing on its first `bench.` import.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_imports import LAYERS, REPO, imported_modules, python_files


def imports_of(paths: list[Path], top: str) -> list[str]:
    """`file:line imports module` for every import of package `top` in `paths`."""
    found = []
    for path in paths:
        for line, module in imported_modules(ast.parse(path.read_text())):
            if module == top or module.startswith(f"{top}."):
                found.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return found


def test_bench_does_not_import_tests() -> None:
    assert imports_of(python_files("bench"), "tests") == []


def test_tests_do_not_import_bench() -> None:
    assert imports_of(python_files("tests"), "bench") == []


def test_the_layers_do_not_import_the_harness() -> None:
    assert imports_of(python_files(*LAYERS), "tenax.testing") == []


def test_the_harness_does_not_need_pytest() -> None:
    harness = python_files("tenax/testing")
    assert harness and imports_of(harness, "pytest") == []


# Every script with a main, except the plain-torch baseline: torchrun runs that one as a path
# and it imports nothing from `bench`.
BENCHES = sorted(p for p in (REPO / "bench").glob("*.py")
                 if "__main__" in p.read_text() and p.name != "plain_torch_train.py")


@pytest.mark.parametrize("script", BENCHES, ids=lambda p: p.stem)
def test_a_bench_run_as_a_path_says_how_to_run_it(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"run it from the repository root as a module: python -m bench.{script.stem} "
        "(as a path, `bench` is not importable)"]
