"""Conventions a scan can hold: line, file and function length, where exceptions live, type
hints on every library function, no reach into another module's private names, one logger per
module, that the orchestrator derives its timeouts in one place, and that the README stays a
short page for users that speaks of the project only.
"""
from __future__ import annotations

import ast
import builtins
import functools
import re
from pathlib import Path
from typing import Iterator

from tests.test_imports import LAYERS, PROJECT, REPO, SOURCE_DIRS, python_files


MAX_LINE = 100
MAX_README_LINES = 250
# How the work was organised (sessions, tickets), which means nothing to a reader of the code.
PROCESS_WORDS = re.compile(r"\bstops? [0-9]+\b|[Ii]ssue [0-9]+|\bitem [0-9]+")
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".txt", ".proto", ".json")


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


LIBRARY = (*LAYERS, "tenax")  # what ships: tests/ and bench/ are not held to these scans
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 50
# Files whose violations another change in flight is fixing (their owner may not be edited
# from here); each scan skips them. Remove an entry once its file is clean.
IN_FLIGHT: dict[str, str] = {}  # file -> why a change in flight may break a scan for now


def library_files() -> list[Path]:
    return [p for p in python_files(*LIBRARY)
            if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """One parse per file for all the scans below (they run over the same files)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def settled(problems: list[str]) -> list[str]:
    """`problems` less those in files listed in IN_FLIGHT."""
    return [p for p in problems if p.split(":", 1)[0] not in IN_FLIGHT]


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def long_files(paths: list[Path], root: Path = REPO) -> list[str]:
    found = []
    for p in paths:
        count = len(p.read_text(encoding="utf-8").splitlines())
        if count > MAX_FILE_LINES:
            found.append(f"{p.relative_to(root)}:1 has {count} lines")
    return found


def long_functions(paths: list[Path], root: Path = REPO) -> list[str]:
    """Functions (methods and nested ones too) longer than MAX_FUNCTION_LINES, counted from
    the `def` line (decorators not included) to the body's last line."""
    return [f"{p.relative_to(root)}:{f.lineno} {f.name} has {f.end_lineno - f.lineno + 1} lines"
            for p in paths for f in functions(parsed(p))
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]


def unannotated(paths: list[Path], root: Path = REPO) -> list[str]:
    """Functions with a parameter (other than self/cls) or the return left without a hint."""
    found = []
    for p in paths:
        for f in functions(parsed(p)):
            a = f.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            missing = [x.arg for x in params
                       if x.annotation is None and x.arg not in ("self", "cls")]
            missing += ["return"] if f.returns is None else []
            if missing:
                found.append(f"{p.relative_to(root)}:{f.lineno} {f.name} has no hint for "
                             + ", ".join(missing))
    return found


def test_no_library_file_is_longer_than_400_lines(tmp_path: Path) -> None:
    problems = settled(long_files(library_files()))
    assert problems == [], "\n".join(problems)
    (tmp_path / "x.py").write_text("x = 1\n" * 401)
    assert long_files([tmp_path / "x.py"], root=tmp_path) == ["x.py:1 has 401 lines"]


def test_no_library_function_is_longer_than_50_lines(tmp_path: Path) -> None:
    problems = settled(long_functions(library_files()))
    assert problems == [], "\n".join(problems)
    ok = "@staticmethod\ndef ok():\n" + "    x = 1\n" * 49  # 50 lines from the def
    long = "class C:\n    def f(self):\n" + "        x = 1\n" * 50  # 51
    (tmp_path / "x.py").write_text(ok + long)
    assert long_functions([tmp_path / "x.py"], root=tmp_path) == ["x.py:53 f has 51 lines"]


def test_every_library_function_is_fully_annotated(tmp_path: Path) -> None:
    problems = settled(unannotated(library_files()))
    assert problems == [], "\n".join(problems)
    (tmp_path / "x.py").write_text(
        "def a(x: int, *args: int, y: str = '', **kw: int) -> None: ...\n"
        "def b(x, /, *args, y: int, **kw): ...\n"
        "class C:\n    def m(self, z: int): ...\n    @classmethod\n    def k(cls) -> int: ...\n")
    assert unannotated([tmp_path / "x.py"], root=tmp_path) == [
        "x.py:2 b has no hint for x, args, kw, return", "x.py:4 m has no hint for return"]


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_bindings(tree: ast.AST) -> set[str]:
    """Private names a module binds: defs, classes, assigned names and parameters, and
    attributes it sets on `self` or `cls` (`self._n += 1` updates a binding, makes none)."""
    names: set[str] = set()
    updated = {id(n.target) for n in ast.walk(tree) if isinstance(n, ast.AugAssign)}
    for node in ast.walk(tree):
        if id(node) in updated:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return {n for n in names if is_private(n)}


def private_reaches(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) for each `x._name` and `getattr(x, "_name")` (setattr, hasattr too), and
    each private module named in an import path."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and is_private(node.args[1].value):
            yield node.lineno, node.args[1].value
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""]
            for part in (p for m in modules if m.split(".")[0] in PROJECT
                         for p in m.split(".") if is_private(p)):
                yield node.lineno, part


def private_name_uses(paths: list[Path], root: Path = REPO) -> list[str]:
    """Private names a module uses that some other scanned module binds and it does not: a
    class's `_field` read through an object or a subclass, a `_helper` read through its full
    dotted path or getattr. Also a private module in an import path. tests/test_imports.py's
    scan follows only the names an import binds, so these pass it. A name that both modules
    bind (two classes with a `_lock` each) is not told apart."""
    bound = {p: private_bindings(parsed(p)) for p in paths}
    anywhere = set().union(*bound.values())
    found = []
    for p in paths:
        imports = import_lines(parsed(p))
        for line, name in private_reaches(parsed(p)):
            if name not in bound[p] and (name in anywhere or line in imports):
                found.append(f"{p.relative_to(root)}:{line} uses {name}")
    return found


def import_lines(tree: ast.AST) -> set[int]:
    return {n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))}


def test_no_library_module_uses_another_modules_private_names(tmp_path: Path) -> None:
    problems = settled(private_name_uses(library_files()))
    assert problems == [], "\n".join(problems)
    (tmp_path / "a.py").write_text("class A:\n    def __init__(self):\n        self._n = 0\n"
                                   "def _helper(): ...\n_TABLE = {}\n")
    (tmp_path / "b.py").write_text(
        "import os, tenax.a\nfrom tenax.workers._inner import x\n"
        "class B(A):\n    def f(self):\n        self._n += 1\n"  # the base class's field
        "def g(a):\n    return a._n, tenax.a._helper(), getattr(tenax.a, '_TABLE')\n"
        "os._exit(0)\n")  # a third-party private name is another matter: not scanned
    problems = private_name_uses([tmp_path / "a.py", tmp_path / "b.py"], root=tmp_path)
    assert sorted(problems) == ["b.py:2 uses _inner", "b.py:5 uses _n", "b.py:7 uses _TABLE",
                                "b.py:7 uses _helper", "b.py:7 uses _n"], problems


def names_bound(tree: ast.AST) -> set[str]:
    """Names a module assigns, imports or takes as parameters."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
    return names


LOGGER = "logger = logging.getLogger(__name__)"
ROOT_CALLS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def logger_problems(paths: list[Path], root: Path = REPO) -> list[str]:
    """A module logs through its one module-level `logger = logging.getLogger(__name__)`: not
    through the root logger (`logging.info(...)`), a second logger of its own, or a `logger` it
    never defined. (`logging.getLogger()` to set the root's level stays allowed: it configures,
    it does not log.)"""
    found = []
    for p in paths:
        tree, rel = parsed(p), p.relative_to(root)
        defined = [n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n) == LOGGER]
        for node in ast.walk(tree):
            call = ast.unparse(node.func) if isinstance(node, ast.Call) else ""
            if call == "logging.getLogger" and node.args \
                    and not (defined and node is defined[0].value):
                found.append(f"{rel}:{node.lineno} makes another logger: {ast.unparse(node)}")
            elif call in {f"logging.{name}" for name in ROOT_CALLS}:
                found.append(f"{rel}:{node.lineno} logs through the root logger: {call}")
        if not defined and "logger" not in names_bound(tree) and any(
                isinstance(n, ast.Name) and n.id == "logger" for n in ast.walk(tree)):
            found.append(f"{rel}:1 uses `logger` without `{LOGGER}`")
    return found


def test_each_library_module_logs_through_its_one_logger(tmp_path: Path) -> None:
    problems = settled(logger_problems(library_files()))
    assert problems == [], "\n".join(problems)
    (tmp_path / "a.py").write_text(f"import logging\n{LOGGER}\nlogging.getLogger().setLevel(1)\n"
                                   "def f():\n    logging.getLogger('x').info('no')\n"
                                   "    logging.warning('no')\n")
    (tmp_path / "b.py").write_text("def f():\n    logger.info('no')\n")
    (tmp_path / "c.py").write_text("def g(logger):\n    logger.info('the caller chose it')\n")
    problems = logger_problems(sorted(tmp_path.glob("*.py")), root=tmp_path)
    assert sorted(p.split(" ", 1)[0] for p in problems) == ["a.py:5", "a.py:6", "b.py:1"], \
        problems


def test_the_readme_is_a_short_page_for_users() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_README_LINES}: design goes to docs/, "
        "measurement history to bench/RESULTS.md")


def test_no_file_speaks_of_how_the_work_was_organised() -> None:
    hits = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if (path.is_dir() or path.suffix not in TEXT_SUFFIXES or not kept(rel.parts[:-1])):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{rel}:{i}: {line.strip()[:80]}")
    assert not hits, "words about how the work was organised:\n" + "\n".join(hits[:20])


def kept(folders: tuple[str, ...]) -> bool:
    """Folders of the project's own text: not Git's, caches, builds or hidden tool state (the
    CI script's folder excepted)."""
    return not any((part.startswith(".") and part != ".ci") or part.endswith(".egg-info")
                   or part in ("__pycache__", "build", "dist") for part in folders)
