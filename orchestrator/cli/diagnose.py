"""`tenax diagnose LOCATION`: read the stacks a hang left (`rank-N.txt` under
`<checkpoint.uri>/diagnostics/<time>-<cause>/`, named by the `failure` event's `diagnostics`
field), group the ranks by the top frames of their training thread, name the odd one out.
A straggler's location (its `evidence.json` says so) holds several samples of the flagged rank
and of one healthy rank: the report gives each one's share of samples per place and the place
where the slow rank spends the most more than the healthy one."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

EXIT_NOTHING_ODD = 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from tenax.workers import diagnose, read_evidence, read_stacks

    stacks, evidence = read_stacks(args.location), read_evidence(args.location)
    if evidence.get("cause") == "straggler":
        return straggler_report(stacks, evidence, args)
    result = diagnose(stacks, top=args.frames)
    if args.json:
        json.dump({"groups": [{"frames": list(frames), "ranks": ranks}
                              for frames, ranks in result.groups], "odd": result.odd},
                  sys.stdout, indent=2)
        print()
    else:
        print(result.render())
    return EXIT_NOTHING_ODD


def straggler_report(stacks: dict[int, str], evidence: dict[str, Any],
                     args: argparse.Namespace) -> int:
    """A straggler's samples: where each rank spent them, and where the slow one differs."""
    from tenax.workers import compare_roles, place_shares

    roles = {int(rank): role for rank, role in evidence.get("roles", {}).items()}
    if args.json:
        json.dump({"evidence": evidence, "ranks": {
            str(rank): {"role": roles.get(rank, "sampled"),
                        "places": [{"frames": place, "share": round(share, 3)}
                                   for place, share in place_shares(text, args.frames)]}
            for rank, text in sorted(stacks.items())}}, sys.stdout, indent=2)
        print()
    else:
        print(compare_roles(stacks, roles, top=args.frames))
    return EXIT_NOTHING_ODD


def register(sub: argparse._SubParsersAction) -> None:
    from tenax.orchestrator.cli.preflight import at_least_one

    p = sub.add_parser("diagnose", help="name a hang's odd rank out, or what a "
                       "straggler does that a healthy rank does not")
    p.add_argument("location", help="a diagnostics directory (local path or fsspec URI)")
    p.add_argument("--frames", type=at_least_one, default=3,
                   help="top frames that make a place (at least 1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_diagnose)
