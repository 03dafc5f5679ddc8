"""Every package face (`__init__` built with `tenax.faces.lazy_face`) has a docstring, its
`__all__` names resolve to the defining modules' objects, and the faces an agent or the
controller imports pull in no torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


LOWER_FACES = ("tenax.checkpoint", "tenax.checkpoint.format", "tenax.checkpoint.load",
               "tenax.checkpoint.save", "tenax.checkpoint.memory", "tenax.parallel")


def test_every_name_of_the_checkpoint_and_parallel_faces_resolves() -> None:
    """Each face's `__all__` names resolve (lazily, through PEP 562 `__getattr__`), and a name
    a face shares with a sub-package's face is the same object."""
    import importlib

    for face in LOWER_FACES:
        module = importlib.import_module(face)
        assert module.__doc__, f"{face} has no docstring"
        unresolved = [name for name in module.__all__ if not hasattr(module, name)]
        assert unresolved == [], f"{face}.__all__ names that do not resolve: {unresolved}"
        parent = importlib.import_module(face.rpartition(".")[0])
        shared = set(module.__all__) & set(getattr(parent, "__all__", ()))
        assert [n for n in shared if getattr(parent, n) is not getattr(module, n)] == []


def test_lower_faces_and_error_modules_import_without_torch() -> None:
    """The faces resolve names only when asked: an agent (or the controller) that catches a
    checkpoint error or reads a layout must not pay for torch."""
    script = ("import sys, " + ", ".join(LOWER_FACES) + ", tenax.checkpoint.errors, "
              "tenax.parallel.errors, tenax.parallel.layout, tenax.parallel.planner\n"
              "sys.exit(1 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr or "torch was imported"


ORCHESTRATOR_FACES = ("tenax.orchestrator", "tenax.orchestrator.chaos",
                      "tenax.orchestrator.placement", "tenax.orchestrator.job",
                      "tenax.orchestrator.service", "tenax.orchestrator.cli")


def test_every_name_of_the_orchestrator_faces_resolves_without_torch() -> None:
    """Each orchestrator face has a docstring and its `__all__` names resolve (a name shared
    with a room's face is the same object); importing the faces and resolving every name
    imports no torch (the controller and the service run without it)."""
    script = textwrap.dedent(f"""
        import importlib, sys

        for face in {ORCHESTRATOR_FACES!r}:
            module = importlib.import_module(face)
            assert module.__doc__, face + " has no docstring"
            missing = [name for name in module.__all__ if not hasattr(module, name)]
            assert not missing, f"{{face}}.__all__ names that do not resolve: {{missing}}"
            parent = importlib.import_module(face.rpartition(".")[0])
            shared = set(module.__all__) & set(getattr(parent, "__all__", ()))
            assert all(getattr(parent, n) is getattr(module, n) for n in shared), face
        sys.exit(1 if "torch" in sys.modules else 0)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr or "torch was imported"


def test_every_name_of_the_workers_face_resolves_without_torch() -> None:
    """`tenax.workers` has a docstring and its `__all__` names resolve to the objects of the
    modules that define them; importing the face and resolving every name but the data
    loader's imports no torch (an agent imports this layer; the loader is a training process's)."""
    script = textwrap.dedent("""
        import importlib, sys
        import tenax.workers as face

        assert face.__doc__, "tenax.workers has no docstring"
        torch_names = {"prepare_token_file"}
        missing = [name for name in face.__all__
                   if name not in torch_names and not hasattr(face, name)]
        assert not missing, f"tenax.workers.__all__ names that do not resolve: {missing}"
        assert face.run_rank is importlib.import_module("tenax.workers.rank").run_rank
        if "torch" in sys.modules:
            sys.exit(1)
        assert all(hasattr(face, name) for name in torch_names)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr or "torch was imported"
