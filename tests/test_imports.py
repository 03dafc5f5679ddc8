"""Imports point one way, and nothing reaches into another module's private names.

Layers, top to bottom: orchestrator -> workers -> checkpoint -> parallel, all under the one
package `tenax`. A module may import its own layer or any layer below it, never one above
(type-only imports under TYPE_CHECKING count too: they couple the code just the same). Inside
a layer the sub-packages have an order of their own (`ROOMS`). The static scan reads every
import statement, wherever it sits (function bodies included); the subprocess check imports the
lower layers with `tenax.orchestrator` made unimportable, so an import hidden behind a string
would fail as well.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("parallel", "checkpoint", "workers", "orchestrator")  # bottom to top
# Inside a layer, bottom to top; "" is the layer's own top-level modules that serve the rooms
# (errors, collectives, spec, loopback), "^" its top-level modules that use them (the manager).
ROOMS = {
    "checkpoint": ("", "format", "load", "save", "memory", "^"),
    "orchestrator": ("", "chaos", "placement", "job", "preflight", "service", "cli"),
}
TOP_MODULES = {"checkpoint": {"manager", "write_launcher", "cli"}}
PROJECT = {"tenax", "bench", "tests"}
SOURCE_DIRS = (*LAYERS, "tenax", "bench", "tests")


def python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py"))


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] in LAYERS:
        parts.insert(0, "tenax")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module) for every import statement in the file."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tenax" and parts[1] in LAYERS else None


def room_of(layer: str, rest: list[str]) -> str:
    """The room of a module given its dotted parts below the layer."""
    if len(rest) > 1:
        return rest[0]
    return "^" if rest and rest[0] in TOP_MODULES.get(layer, ()) else ""


def layer_violations(paths: list[Path], root: Path = REPO) -> list[str]:
    found = []
    for path in paths:
        own = LAYERS.index(path.relative_to(root).parts[0])
        for line, module in imported_modules(ast.parse(path.read_text())):
            top = layer_of(module)
            if top is not None and LAYERS.index(top) > own:
                found.append(f"{path.relative_to(root)}:{line} imports {module} "
                             f"({LAYERS[own]} sits below {top})")
            if module.split(".")[0] in LAYERS:
                found.append(f"{path.relative_to(root)}:{line} imports {module} "
                             f"(not under tenax: the folder is not a top-level package)")
    return found


def room_violations(paths: list[Path], root: Path = REPO) -> list[str]:
    """A sub-package imports only its own room or the rooms below it in `ROOMS`."""
    found = []
    for path in paths:
        layer, *rest = path.relative_to(root).with_suffix("").parts
        if layer not in ROOMS:
            continue
        order = ROOMS[layer]
        own = room_of(layer, rest)
        for line, module in imported_modules(ast.parse(path.read_text())):
            parts = module.split(".")
            if layer_of(module) != layer or len(parts) < 3:
                continue
            other = room_of(layer, parts[2:])
            if other not in order or own not in order:
                found.append(f"{path.relative_to(root)}:{line} imports {module} "
                             f"(room {other or own!r} is not in ROOMS[{layer!r}])")
            elif order.index(other) > order.index(own):
                found.append(f"{path.relative_to(root)}:{line} imports {module} "
                             f"({layer}/{own or '.'} sits below {layer}/{other})")
    return found


def private_name_imports(paths: list[Path], root: Path = REPO) -> list[str]:
    """`from project.module import _name` or `project_module._name` across modules."""
    found = []
    for path in paths:
        tree, me = ast.parse(path.read_text()), module_name(path, root)
        aliases: dict[str, str] = {}  # local name -> project module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] in PROJECT and node.module != me:
                for alias in node.names:
                    if is_private(alias.name):
                        found.append(f"{path.relative_to(root)}:{node.lineno} imports "
                                     f"{alias.name} from {node.module}")
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PROJECT and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and is_private(node.attr) \
                    and is_module(aliases[node.value.id]):
                found.append(f"{path.relative_to(root)}:{node.lineno} reads "
                             f"{aliases[node.value.id]}.{node.attr}")
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_module(dotted: str) -> bool:
    """Whether `dotted` names a project module (not a class or function in one)."""
    parts = dotted.split(".")
    if parts[0] == "tenax" and len(parts) > 1 and parts[1] in LAYERS:
        parts = parts[1:]
    path = REPO.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_lower_layers_never_import_higher_ones() -> None:
    problems = layer_violations(python_files(*LAYERS))
    assert problems == [], "\n".join(problems)


def test_sub_packages_import_one_way_inside_their_layer() -> None:
    problems = room_violations(python_files(*ROOMS))
    assert problems == [], "\n".join(problems)


def test_the_room_scan_catches_an_upward_import(tmp_path: Path) -> None:
    for rel, text in {"checkpoint/format/fake.py": "from tenax.checkpoint.save.writer import x\n",
                      "orchestrator/job/fake.py": "import tenax.orchestrator.service.jobs\n",
                      "orchestrator/chaos/ok.py": "from tenax.orchestrator.spec import JobSpec\n"
                      }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    problems = room_violations(sorted(tmp_path.rglob("*.py")), root=tmp_path)
    assert len(problems) == 2, problems
    assert any("checkpoint/format sits below checkpoint/save" in p for p in problems)
    assert any("orchestrator/job sits below orchestrator/service" in p for p in problems)


def test_no_module_imports_another_modules_private_names() -> None:
    problems = private_name_imports(python_files(*SOURCE_DIRS))
    assert problems == [], "\n".join(problems)


def is_sys_path(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" \
        and isinstance(node.value, ast.Name) and node.value.id == "sys"


def sys_path_edits(paths: list[Path]) -> list[str]:
    """`sys.path.insert(...)` (any method of it), `sys.path += ...`, `sys.path = ...`."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and is_sys_path(node.value)) \
                    or (isinstance(node, ast.Assign) and any(map(is_sys_path, node.targets))) \
                    or (isinstance(node, ast.AugAssign) and is_sys_path(node.target)):
                found.append((path.name, node.lineno))
    return [f"{name}:{line}" for name, line in sorted(found)]


def test_bench_and_tests_do_not_edit_sys_path() -> None:
    edits = sys_path_edits(python_files("bench", "tests"))
    assert edits == [], "helpers are shared through importable modules, not sys.path: " \
        + ", ".join(edits)


def test_the_sys_path_scan_catches_edits(tmp_path: Path) -> None:
    fake = tmp_path / "fake.py"
    fake.write_text("import sys\nprint(sys.path)\nsys.path.insert(0, 'x')\nsys.path += ['y']\n"
                    "sys.path = []\n")
    assert sys_path_edits([fake]) == ["fake.py:3", "fake.py:4", "fake.py:5"]


@pytest.mark.parametrize("bad, expected", [
    ("from tenax.orchestrator.spec import JobSpec\n", "parallel sits below orchestrator"),
    ("def f():\n    import tenax.workers.trainer\n", "parallel sits below workers"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tenax.checkpoint import x\n",
     "parallel sits below checkpoint"),
])
def test_the_layer_scan_catches_each_kind_of_import(tmp_path: Path, bad: str,
                                                     expected: str) -> None:
    fake = tmp_path / "parallel" / "fake.py"
    fake.parent.mkdir()
    fake.write_text(bad)
    problems = layer_violations([fake], root=tmp_path)
    assert len(problems) == 1 and expected in problems[0]


def test_the_private_scan_catches_names_and_attributes(tmp_path: Path) -> None:
    fake = tmp_path / "bench" / "fake.py"
    fake.parent.mkdir()
    fake.write_text("from tenax.parallel.comm_counter import _X\n"
                    "import tenax.parallel.layout as lay\nlay._hidden\n"
                    "from tenax.parallel import layout\nlayout._other\n")
    problems = private_name_imports([fake], root=tmp_path)
    assert [p.split(" ", 1)[1] for p in problems] == [
        "imports _X from tenax.parallel.comm_counter", "reads tenax.parallel.layout._hidden",
        "reads tenax.parallel.layout._other"]


def test_lower_layers_import_with_orchestrator_blocked() -> None:
    """Import every module of parallel/, checkpoint/ and workers/ in a fresh interpreter in
    which any attempt to import orchestrator raises."""
    modules = [module_name(p) for p in python_files("parallel", "checkpoint", "workers")]
    script = textwrap.dedent(f"""
        import importlib, sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "tenax.orchestrator" or name.startswith("tenax.orchestrator."):
                    raise ImportError(f"blocked: {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        for name in {modules!r}:
            importlib.import_module(name)
        loaded = sorted(m for m in sys.modules if m.startswith("tenax.orchestrator"))
        print("orchestrator modules loaded:", loaded)
        sys.exit(1 if loaded else 0)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_agents_and_the_controller_start_without_torch() -> None:
    """A rank's agent (a Ray actor per GPU) and the controller never run torch: importing it
    cost each agent ~3 s of CPU at every placement (the forkserver under the agent, which the
    training processes fork from, preloads it instead)."""
    script = ("import sys, tenax.workers.worker, tenax.orchestrator.placement.worker_group, "
              "tenax.orchestrator.job.controller, tenax.orchestrator.service.server\n"
              "sys.exit(1 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr or "torch was imported"


def test_a_training_process_imports_nothing_past_the_forkserver_preload(tmp_path: Path) -> None:
    """Every rank's training process forks from a forkserver that preloaded `PRELOAD`; what a
    process still imports itself, every restarted rank pays again before its first step (a
    lazy numpy.ma import alone cost 0.04 s). Trains two steps with a storage checkpoint and
    an in-memory snapshot, then resumes, and lists what that imported past the preload."""
    script = textwrap.dedent(f"""
        import importlib, os, sys
        from tenax.workers.zygote import PRELOAD
        from tenax.workers.memory_options import MemoryOptions
        from tenax.workers.rank import RankOptions, run_rank
        from tenax.workers.rendezvous import free_port
        from tests.ckpt_jobs import ckpt_spec

        for name in PRELOAD:
            importlib.import_module(name)
        spec = ckpt_spec("file://{tmp_path}/ck", ["train.steps=3", "checkpoint.every_steps=2"])
        spec, memory = spec.to_dict(), MemoryOptions(snapshot_dir="{tmp_path}", every_steps=1)
        before = set(sys.modules)
        for steps in (2, None):
            run_rank(RankOptions(spec, {{"dp": 1}}, 0, 1, "127.0.0.1", free_port(), steps=steps,
                                 memory=memory))
        ours = ("tenax.workers", "tenax.checkpoint", "tenax.parallel", "numpy", "fsspec",
                "torch.distributed")
        late = sorted(m for m in set(sys.modules) - before if m.startswith(ours))
        print("imported past the preload:", late)
        sys.exit(1 if late else 0)
    """)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def face_bypasses(paths: list[Path], root: Path = REPO) -> list[str]:
    """Imports of another layer's inner module instead of a package face (an `__init__`)."""
    found = []
    for path in paths:
        own = path.relative_to(root).parts[0]
        for line, module in imported_modules(ast.parse(path.read_text())):
            layer = layer_of(module)
            if layer is None or layer == own:
                continue
            if not (root.joinpath(*module.split(".")[1:]) / "__init__.py").is_file():
                found.append(f"{path.relative_to(root)}:{line} imports {module} "
                             f"(import from the face of tenax.{layer} instead)")
    return found


def test_other_layers_are_imported_through_their_faces() -> None:
    problems = face_bypasses(python_files(*LAYERS))
    assert problems == [], "\n".join(problems)


def test_the_face_scan_catches_an_inner_module(tmp_path: Path) -> None:
    (tmp_path / "workers").mkdir()
    (tmp_path / "checkpoint" / "save").mkdir(parents=True)
    (tmp_path / "checkpoint" / "__init__.py").write_text("")
    (tmp_path / "checkpoint" / "save" / "__init__.py").write_text("")
    fake = tmp_path / "workers" / "fake.py"
    fake.write_text("from tenax.checkpoint import CheckpointManager\n"
                    "from tenax.checkpoint.save import Stager\n"
                    "from tenax.checkpoint.save.writer import x\n"
                    "import tenax.checkpoint.manager\n")
    problems = face_bypasses([fake], root=tmp_path)
    assert [p.split(" ")[2] for p in problems] == ["tenax.checkpoint.save.writer",
                                                   "tenax.checkpoint.manager"]


def test_the_forkserver_imports_without_the_collector_and_training_runs_with_it() -> None:
    """The collector's passes over the growing heap were a fifth of the preload's CPU: the
    forkserver imports with it off, and a training process freezes what it inherited and
    turns it on again."""
    script = textwrap.dedent("""
        import gc, sys
        import tenax.workers.import_pause
        off = not gc.isenabled()
        from tenax.workers.worker import settle_inherited_heap
        settle_inherited_heap()
        sys.exit(0 if off and gc.isenabled() and gc.get_freeze_count() > 0 else 1)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
