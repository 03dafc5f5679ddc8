"""How the repository's `bench/` scripts insist on being run as modules.

`python bench/NAME.py` puts `bench/` itself on sys.path, not the repository root, so the
script's own `from bench.common import ...` fails with "No module named 'bench'". A script
calls `exit_unless_run_as_module(__spec__, __file__)` before its first `bench.` import, and a
path run ends with one line saying what to type instead.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PATH_RUN_EXIT = 2  # a usage error, as argparse exits for one


def exit_unless_run_as_module(spec: Any, file: str) -> None:
    """Return when the calling script was imported or run with `python -m`; else print how to
    run it and exit with status 2. `spec` and `file` are the script's `__spec__`, `__file__`
    (a script run as a path has no module spec)."""
    if spec is not None:
        return
    path = Path(file).resolve()
    module = f"{path.parent.name}.{path.stem}"
    print(f"run it from the repository root as a module: python -m {module} "
          f"(as a path, `{path.parent.name}` is not importable)", file=sys.stderr)
    raise SystemExit(PATH_RUN_EXIT)
