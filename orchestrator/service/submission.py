"""What a submission is before it becomes a job: parsing and checks, and the Ray it runs on.

Split from orchestrator/service/jobs.py (which re-exports these names): parsing a spec from the wire
(JSON only, bounded sizes, overrides typed by the model) and joining or starting the Ray
cluster are independent of how jobs are queued and run.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from tenax.orchestrator.loopback import prompt_node_start
from tenax.orchestrator.spec import JobSpec, SpecError, apply_overrides, spec_from_dict

logger = logging.getLogger(__name__)

MAX_SPEC_CHARS = 1 << 20
MAX_OVERRIDES, MAX_OVERRIDE_CHARS = 200, 4096


def default_gpu_slots() -> int:
    """Real GPUs if torch sees any; otherwise one rank slot per CPU core."""
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception as err:  # a broken CUDA install must not stop a CPU server
        logger.warning("cannot count GPUs (%s); using CPU slots", err)
        count = 0
    return count or (os.cpu_count() or 1)


@dataclass
class RayLink:
    """What `connect_ray` leaves besides Ray itself: with an embedded Ray, this node's
    forkserver, which every job's agents on this node fork from ({"node_id", "endpoint"}; None
    when joining a cluster), and the embedded Ray's temp dir. `close()` after ray.shutdown()
    stops the forkserver and removes that dir: each start makes a fresh one (sockets, session
    logs), so keeping them would leave one more behind at every `tenax run` or restart."""
    forkserver: dict[str, Any] | None = None
    server: Any = None  # the NodeForkServer this process started
    temp_dir: str | None = None  # the embedded Ray's, ours to remove

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


# What Ray puts below its temp dir before a socket's name ("/tenax-ray-XXXXXXXX", then
# "/session_<date>_<time>_<us>_<pid>/sockets/plasma_store"), and the AF_UNIX path limit.
RAY_SOCKET_SUFFIX = 19 + 44 + 21
AF_UNIX_MAX = 107


def ray_temp_parent() -> str | None:
    """Where the embedded Ray's temp dir goes: $RAY_TMPDIR (Ray's own setting, which an explicit
    `_temp_dir` would otherwise override), else the system temp dir (None). A $RAY_TMPDIR too
    long for Ray's socket paths would fail `ray.init`: the system temp dir then, logged."""
    parent = os.environ.get("RAY_TMPDIR") or None
    if parent and len(os.path.abspath(parent)) + RAY_SOCKET_SUFFIX > AF_UNIX_MAX:
        logger.info("RAY_TMPDIR %s is too long for Ray's socket paths (%d bytes at most): the "
                    "embedded Ray's temp dir goes to %s", parent, AF_UNIX_MAX,
                    tempfile.gettempdir())
        return None
    if parent:
        os.makedirs(parent, exist_ok=True)
    return parent


def connect_ray(address: str | None, gpus: int | None, cpus: int | None) -> RayLink:
    """Join a cluster, or start an embedded one on 127.0.0.1 (ray.shutdown() stops it).

    Embedded, a forkserver with the training stack imported is started first, so that its
    imports overlap Ray's start, and every job on this node forks its training processes from
    it: a service job pays no import at all (each job's zygote would otherwise pay one)."""
    if address:
        import ray

        ray.init(address=address, log_to_driver=False, configure_logging=False)
        logger.info("connected to the Ray cluster at %s", address)
        return RayLink()
    from tenax.workers import PRELOAD, NodeForkServer

    link = RayLink(server=NodeForkServer(PRELOAD))
    try:
        import ray

        prompt_node_start()  # started once its raylet registers, not at Ray's next second
        slots = gpus if gpus is not None else default_gpu_slots()
        link.temp_dir = tempfile.mkdtemp(prefix="tenax-ray-", dir=ray_temp_parent())
        ray.init(num_cpus=cpus or max(os.cpu_count() or 1, slots), num_gpus=slots,
                 include_dashboard=False, _node_ip_address="127.0.0.1",
                 _temp_dir=link.temp_dir, log_to_driver=False, configure_logging=False)
        node = ray.get_runtime_context().get_node_id()
    except BaseException:
        link.close()
        raise
    logger.info("started an embedded Ray with %d GPU slot(s) (temp dir %s); jobs fork from "
                "forkserver pid %d", slots, link.temp_dir, link.server.endpoint.pid)
    link.forkserver = {"node_id": node, "endpoint": dataclasses.asdict(link.server.endpoint)}
    return link


def parse_submission(spec_json: str, overrides: list[str],
                     check_raw: Callable[[dict[str, Any]], None] | None = None) -> JobSpec:
    """JSON text (+ `KEY=VALUE` overrides) -> JobSpec; SpecError naming the field otherwise.

    `check_raw` sees the spec after the overrides and before validation, which may open files
    the spec names (the tokenizer, `init_from`): the storage-root check goes there.

    JSON only on the wire (DESIGN.md pins it): YAML aliases would let one request expand into
    gigabytes. The CLI converts a YAML file to JSON before sending it.
    """
    if not spec_json.strip():
        raise SpecError("spec_json: required (a JSON object; '{}' for the default job)")
    if len(spec_json) > MAX_SPEC_CHARS:
        raise SpecError(f"spec_json: {len(spec_json)} characters, more than {MAX_SPEC_CHARS}")
    try:
        raw = json.loads(spec_json)
    except (ValueError, RecursionError) as err:
        raise SpecError(f"spec_json: not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"spec_json: top level must be an object, got {type(raw).__name__}")
    if len(overrides) > MAX_OVERRIDES or any(len(o) > MAX_OVERRIDE_CHARS for o in overrides):
        raise SpecError(f"overrides: at most {MAX_OVERRIDES}, each at most "
                        f"{MAX_OVERRIDE_CHARS} characters")
    try:
        raw = apply_overrides(raw, overrides)
    except SpecError:
        raise
    except (yaml.YAMLError, ValueError, TypeError, RecursionError, ArithmeticError) as err:
        # a value is parsed as YAML (typed by its field): unterminated lists and the like
        raise SpecError(f"overrides: {type(err).__name__}: {err}") from None
    if check_raw is not None:
        check_raw(raw)
    try:
        spec = spec_from_dict(raw)
    except RecursionError:
        raise SpecError("spec_json: nested too deeply") from None
    if spec.model.init_from is not None:  # bad weights refuse the job, not fail its ranks
        from tenax.workers.hf import HFLoadError, check_init_from

        try:
            check_init_from(spec)
        except HFLoadError as err:
            raise SpecError(str(err)) from None
    return spec


def spec_json_of(spec: JobSpec) -> str:
    return json.dumps(spec.model_dump(mode="json", by_alias=True), sort_keys=True)
