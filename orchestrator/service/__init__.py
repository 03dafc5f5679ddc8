"""tenax.orchestrator.service — `tenax serve`: many jobs on one cluster, over gRPC.

- `serve`, `ServeConfig`: run the service; `JobServer`, `ServerOptions`: the gRPC server of
  the pinned `JobService`, whose calls `JobServicer` answers.
- `JobManager`: one controller thread per job, every event stored before it is seen;
  `JobStore` (`JobRecord`, `EventRecord`): the durable history a restart resumes from.
- Scheduling: the pure `decide(SchedulingSnapshot) -> [SchedulingDecision]` (a
  `SchedulingAction` and its reason per job), over `JobView`s and the `Cluster`; `Dispatcher`
  executes it; `wait_for_gpus` queues a `tenax run` on a shared cluster.
- Guards: `TokenAuth`, `check_exposure`, `read_tokens`, `read_identities`; `StorageRoots`,
  `canonical_uri`; `ServiceLimits`, `Identity` (queue caps, priorities, kept history).
- Submissions and the wire: `parse_submission`, `connect_ray`; `job_message`, `event_message`,
  `job_dict`, `event_dict`, `state_name`.

Names resolve lazily (PEP 562): importing this package imports neither gRPC nor Ray.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "server": ("JobServer", "ServeConfig", "ServerOptions", "serve"),
    "servicer": ("JobServicer",),
    "jobs": ("JobManager",),
    "store": ("EventRecord", "JobRecord", "JobStore"),
    "scheduling_policy": ("Cluster", "JobView", "SchedulingAction", "SchedulingDecision",
                          "SchedulingSnapshot", "decide"),
    "scheduler": ("Dispatcher", "wait_for_gpus"),
    "auth": ("TokenAuth", "check_exposure", "read_identities", "read_tokens"),
    "limits": ("Identity", "ServiceLimits"),
    "storage_roots": ("StorageRoots", "canonical_uri"),
    "submission": ("connect_ray", "parse_submission"),
    "wire": ("event_dict", "event_message", "job_dict", "job_message", "state_name"),
}

__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
