"""`tenax diagnose LOCATION`: read the stacks a hang left (`rank-N.txt` under
`<checkpoint.uri>/diagnostics/<time>-<cause>/`, named by the `failure` event's `diagnostics`
field), group the ranks by the top frames of their training thread, name the odd one out."""
from __future__ import annotations

import argparse
import json
import logging
import sys

logger = logging.getLogger(__name__)

EXIT_NOTHING_ODD = 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from tenax.workers import diagnose, read_stacks

    result = diagnose(read_stacks(args.location), top=args.frames)
    if args.json:
        json.dump({"groups": [{"frames": list(frames), "ranks": ranks}
                              for frames, ranks in result.groups], "odd": result.odd},
                  sys.stdout, indent=2)
        print()
    else:
        print(result.render())
    return EXIT_NOTHING_ODD


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="group a hang's rank stacks and name the odd one out")
    p.add_argument("location", help="a diagnostics directory (local path or fsspec URI)")
    p.add_argument("--frames", type=int, default=3, help="top frames that make a place")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_diagnose)
