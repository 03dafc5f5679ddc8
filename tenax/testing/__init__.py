"""The real-Ray harness shared by the test suite and the benchmarks (`bench/`).

- `clusters`: Ray on 127.0.0.1, an embedded single node (`start_local_ray`, `local_ray`) or
  a `ray.cluster_utils.Cluster` of several raylets (`start_cluster`, `ray_cluster`).
- `jobs`: the small job spec (`SMALL`, `make_spec`), a Controller run in a thread with its
  events timed (`JobRun`, `run_job`), the single-process reference losses and their
  comparison, `tenax` CLI runs and `--log-json` files.
- `ranks`: a function on N gloo ranks in forkserver processes with deadlines (`run_ranks`).
- `checkpoint_jobs`: rank functions that leave a checkpoint behind (`save_one_step`).
- `scripts`: the bench scripts' refusal to run as a path.

It sits above every layer (it may import any of them; none of them imports it) and needs no
pytest: the benchmarks run without it. Names are imported lazily, so importing one module
does not import Ray or torch.
"""
from __future__ import annotations

from tenax.faces import lazy_face

_MODULES = {
    "clusters": ("loopback", "start_local_ray", "local_ray", "start_cluster", "ray_cluster"),
    "jobs": ("SMALL", "job_overrides", "make_spec", "JobRun", "run_job", "mismatched_steps",
             "assert_same_losses", "reference_losses", "run_cli", "read_events"),
    "ranks": ("run_ranks", "rank_context", "preload_in_ranks", "init_gloo", "shutdown_gloo"),
    "checkpoint_jobs": ("save_one_step",),
    "scripts": ("exit_unless_run_as_module",),
}
__all__, __getattr__, __dir__ = lazy_face(__name__, _MODULES)
