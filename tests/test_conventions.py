"""Conventions a scan can hold: line length, where exceptions live, and that the orchestrator
derives its timeouts in one place.
"""
from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

from tests.test_imports import LAYERS, REPO, SOURCE_DIRS, python_files


MAX_LINE = 100


def long_lines(paths: list[Path], root: Path = REPO) -> list[str]:
    """Lines over MAX_LINE characters (generated gRPC modules are exempt: protoc writes them)."""
    return [f"{p.relative_to(root)}:{i} has {len(line)} characters"
            for p in paths if not p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_LINE]


def test_no_source_line_is_longer_than_100_characters(tmp_path: Path) -> None:
    problems = long_lines(python_files(*SOURCE_DIRS))
    assert problems == [], "\n".join(problems)
    fake = tmp_path / "fake.py"
    fake.write_text("x = 1\n" + "y = '" + "é" * 95 + "'\n")  # 101 characters, more bytes
    assert long_lines([fake], root=tmp_path) == ["fake.py:2 has 101 characters"]


TIMING_FIELDS = re.compile(r"fault_tolerance\.(heartbeat_interval_s|heartbeat_timeout_s|"
                           r"hang_timeout_s)")


def test_the_orchestrator_reads_timing_fields_only_through_timeouts() -> None:
    """orchestrator/timeouts.py derives every bound from the spec's timing fields once; a
    module that read one by name would give a role its own rule."""
    problems = [f"{p.relative_to(REPO)}:{i}" for p in python_files("orchestrator")
                if p.name != "timeouts.py"
                for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                if TIMING_FIELDS.search(line)]
    assert problems == [], problems


def exception_classes(paths: list[Path], root: Path = REPO) -> list[str]:
    """Exception classes defined outside a package's errors.py (a class whose base's name ends
    in Error or Exception, or is one of the builtin exceptions)."""
    builtin = {name for name in dir(builtins) if name.endswith(("Error", "Exception"))}
    found = []
    for p in paths:
        if p.name == "errors.py" or p.name.endswith("_pb2.py"):
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b).split(".")[-1].endswith(("Error", "Exception", "Interrupted"))
                    or ast.unparse(b) in builtin for b in node.bases):
                found.append(f"{p.relative_to(root)}:{node.lineno} {node.name}")
    return found


def test_exceptions_live_in_each_packages_errors_module(tmp_path: Path) -> None:
    problems = exception_classes(python_files(*LAYERS))
    assert problems == [], problems
    (tmp_path / "x.py").write_text("class A(ValueError): ...\nclass B(faults.ChaosError): ...\n"
                                   "class C: ...\n")
    assert exception_classes([tmp_path / "x.py"], root=tmp_path) == ["x.py:1 A", "x.py:2 B"]
