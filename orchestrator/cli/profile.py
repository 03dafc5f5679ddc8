"""`tenax profile JOB_ID --steps N`: ask a service job's ranks for a torch.profiler trace of
their next N steps (the `ProfileJob` RPC). Prints where the traces will be; the job's `profile`
event (`tenax watch JOB_ID`) says when they are there. `--wait` follows the job's events until
then."""
from __future__ import annotations

import argparse
import logging
from typing import Any

from tenax.orchestrator.cli.client import Client, client_flags, rpc_command

logger = logging.getLogger(__name__)


@rpc_command
def cmd_profile(args: argparse.Namespace, client: Client) -> int:
    from tenax.proto import jobs_pb2 as pb

    reply = client.call("ProfileJob", pb.ProfileJobRequest(job_id=args.job_id, steps=args.steps))
    print(f"job {reply.job_id}: every rank ({reply.ranks}) profiles the {args.steps} step(s) "
          f"after step {reply.step} into {reply.location}")
    if not args.wait:
        print(f"the job's `profile` event says when the traces are there (tenax watch "
              f"{reply.job_id})")
        return 0
    event = wait_for_profile(client, reply.job_id, reply.request)
    if event is None:
        print("the job ended before the window was recorded")
        return 1
    print(f"traces of steps {event['steps'][0]}-{event['steps'][1]} are at "
          f"{event['diagnostics']}")
    return 0


def wait_for_profile(client: Client, job_id: str, request: int) -> dict[str, Any] | None:
    """The job's `profile` event answering `request`, or None when the job's stream ends."""
    from tenax.orchestrator.service.wire import event_dict
    from tenax.proto import jobs_pb2 as pb

    stream = client.stub.WatchJob(pb.WatchJobRequest(job_id=job_id), metadata=client.metadata)
    for message in stream:
        if message.kind == "profile":
            event = event_dict(message)
            if event.get("request") == request:
                stream.cancel()
                return event
    return None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="a torch.profiler trace of a service job's next steps")
    p.add_argument("job_id")
    from tenax.orchestrator.cli.preflight import at_least_one

    p.add_argument("--steps", type=at_least_one, required=True, help="how many steps to record")
    p.add_argument("--wait", action="store_true",
                   help="wait until the traces are written and print where")
    client_flags(p)
    p.set_defaults(func=cmd_profile)

