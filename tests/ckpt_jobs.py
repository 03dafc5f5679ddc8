"""Per-rank jobs for the checkpoint tests (importable by spawned ranks).

`chain_job` runs a sequence of layouts in ONE set of processes: each phase forms a fresh gloo
group of the phase's world size (FileStore rendezvous, so no ports to agree on), builds a
trainer, loads the newest checkpoint, records the full state it loaded, trains, records the
full state it saves, saves, and destroys the group. Ranks outside a phase's world wait for the
next one. So one spawn checks many layout changes, and every phase also checks that a process
can destroy its group and work again with another world size.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from tenax.checkpoint.config import CheckpointConfig
from tenax.workers.checkpoint_config import checkpoint_config
from tenax.workers.rendezvous import forget_dtensor_caches
from tests.engine_jobs import TINY

BASE = TINY + ["train.global_batch_size=12", "train.steps=20"]
MOE = ["model.moe={num_experts: 4, top_k: 2, capacity_factor: 4.0}"]


def ckpt_spec(uri: str, extra: list[str] | None = None):
    from tenax.orchestrator.spec import load_spec

    return load_spec(overrides=BASE + [f"checkpoint.uri={uri}"] + (extra or []))


def ckpt_config(uri: str, extra: list[str] | None = None) -> CheckpointConfig:
    """The checkpoint layer's config of `ckpt_spec(uri, extra)`."""
    return checkpoint_config(ckpt_spec(uri, extra))


def world_of(layout: dict[str, Any]) -> int:
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)


@torch.no_grad()
def full_state(trainer: Any) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer moment as a full CPU tensor by canonical key (collective).

    Goes through `training_state` (what a checkpoint holds) and gathers DTensors with
    `full_tensor()`, then pipeline stages with all_gather_object, so two layouts compare
    key by key.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tenax.checkpoint.load.reshard import training_state

    mine = {}
    for key, value in training_state(trainer).items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        mine[key] = full.detach().cpu().clone()
    if trainer.layout.pp == 1:
        return mine
    everyone: list[Any] = [None] * trainer.layout.pp
    dist.all_gather_object(everyone, mine, group=trainer.mesh["pp"].get_group())
    return {k: v for part in everyone for k, v in part.items()}


def _phase(rank: int, world: int, phase: dict[str, Any], uri: str, extra: list[str],
           writer: str) -> dict[str, Any]:
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = ckpt_spec(uri, extra)
    layout = ParallelLayout(**{"micro_batch_size": 1, **phase["layout"]})
    trainer = Trainer(spec, layout)
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, writer=writer,
                           timeout_s=60) as mgr:
        loaded_step = mgr.load(layout)
        loaded = full_state(trainer) if loaded_step is not None else None
        cursor = trainer.loader.state_dict()["samples_consumed"]
        losses = {trainer.step + 1 + i: trainer.run_step().loss for i in range(phase["steps"])}
        saved = full_state(trainer)
        mgr.save(trainer.step)
        mgr.wait()
        events = mgr.drain_events()
    return {"loaded_step": loaded_step, "trainer_step_after_load": trainer.step - phase["steps"],
            "cursor_after_load": cursor, "losses": losses, "events": events,
            "loaded": loaded if rank == 0 else None, "saved": saved if rank == 0 else None}


def chain_job(rank: int, world_max: int, phases: list[dict[str, Any]], uri: str,
              store_dir: str, extra: list[str], writer: str = "auto") -> list[dict[str, Any]]:
    import torch.distributed as dist

    from tests.distributed import shutdown_gloo

    shutdown_gloo()  # run_ranks' group; every phase forms its own
    forget_dtensor_caches()
    out = []
    for i, phase in enumerate(phases):
        world = world_of(phase["layout"])
        if rank >= world:
            out.append(None)
            continue
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/pg-{i}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        try:
            out.append(_phase(rank, world, phase, uri, extra, writer))
        finally:
            shutdown_gloo()
            forget_dtensor_caches()
    return out


def train_losses(rank: int, world: int, steps: int, extra: list[str]) -> list[float]:
    """The uninterrupted single-rank run's losses (step i+1 at index i)."""
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    trainer = Trainer(ckpt_spec("memory://unused", extra), ParallelLayout(micro_batch_size=1))
    return [trainer.run_step().loss for _ in range(steps)]


def roundtrip_job(rank: int, world: int, uri: str, options: dict | None,
                  writer: str) -> dict[str, Any]:
    """Save after 2 steps, load into a fresh trainer in this process; both take a step."""
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec, layout = ckpt_spec(uri), ParallelLayout(micro_batch_size=1)
    first = Trainer(spec, layout)
    for _ in range(2):
        first.run_step()
    with CheckpointManager(checkpoint_config(spec), first, rank, world, writer=writer,
                           storage_options=options) as mgr:
        mgr.save(2)
        event = mgr.wait()
    second = Trainer(spec, layout)
    with CheckpointManager(checkpoint_config(spec), second, rank, world,
                           storage_options=options) as mgr:
        step = mgr.load()
    a, b = full_state(first), full_state(second)
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    return {"event": event, "step": step, "diffs": diffs, "keys_equal": a.keys() == b.keys(),
            "losses": (first.run_step().loss, second.run_step().loss)}


class DictState:
    """A minimal StateProvider without a trainer or process group (fast in-process tests)."""

    def __init__(self, seed: int = 0, numel: int = 1000) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tensors = {"model.w": torch.randn(numel, generator=gen),
                        "model.b": torch.randn(7, 3, generator=gen)}
        self.step = 0

    def train(self) -> None:
        self.step += 1
        for t in self.tensors.values():
            t.add_(1.0)

    def state_for_save(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def state_for_load(self) -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(v) for k, v in self.tensors.items()}

    def apply_loaded(self, tensors: dict[str, torch.Tensor], *, step: int,
                     data_cursor: int) -> None:
        self.tensors = {k: v.clone() for k, v in tensors.items()}
        self.step = step

    def describe(self) -> dict[str, Any]:
        return {"layout": {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0},
                "data_cursor": self.step * 12, "seed": 0}


def killable_job(uri: str, pause_dir: str, writer: str, queue: Any) -> None:
    """World 1: commit step 1, then start saving step 2 with a paused writer; report and wait.

    The test kills the writer (or this whole process) while it is paused mid-shard.
    """
    os.environ["TENAX_CKPT_FAULT"] = ""
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer
    from tests.distributed import free_port, init_gloo

    init_gloo(0, 1, free_port())
    spec = ckpt_spec(uri)
    trainer = Trainer(spec, ParallelLayout(micro_batch_size=1))
    mgr = CheckpointManager(checkpoint_config(spec), trainer, 0, 1, writer=writer, timeout_s=60)
    trainer.run_step()
    mgr.save(1)
    first = mgr.wait()
    trainer.run_step()
    os.environ["TENAX_CKPT_FAULT"] = f"pause:{pause_dir}"
    mgr.save(2)
    queue.put({"first": first, "pid": os.getpid()})
    second = mgr.wait()  # returns once the test killed our writer child
    trainer.run_step()  # training goes on after a failed save
    queue.put({"second": second, "step": trainer.step})


def save_modes_job(rank: int, world: int, root: str, writers: list[str]) -> dict[str, Any]:
    """dp2 ZeRO-1: for each writer, two saves (the second reuses the plan) into root/<writer>."""
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    out = {}
    for writer in writers:
        spec = ckpt_spec(f"file://{root}/{writer}")
        trainer = Trainer(spec, ParallelLayout(dp=2, zero=1, micro_batch_size=1))
        with CheckpointManager(checkpoint_config(spec), trainer, rank, world, writer=writer,
                               timeout_s=60) as mgr:
            for _ in range(2):
                trainer.run_step()
                mgr.save(trainer.step)
            mgr.wait()
            out[writer] = mgr.drain_events()
    return out


def load_and_step_job(rank: int, world: int, uri: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Load the newest committed version into `layout` and take one step."""
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = ckpt_spec(uri)
    trainer = Trainer(spec, ParallelLayout(micro_batch_size=1, **layout))
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=60) as mgr:
        step = mgr.load()
    cursor = trainer.loader.state_dict()["samples_consumed"]
    return {"step": step, "cursor": cursor, "loss": trainer.run_step().loss}


def snapshot_job(rank: int, world: int, root: str, writers: list[str]) -> dict[str, Any]:
    """A save is a snapshot: train on right after save() returns, then load what was saved.

    Returns, per writer, the largest difference between the state at save() and the state
    loaded back (into a fresh trainer) after two more steps had run during the write.
    """
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    layout = ParallelLayout(dp=2, zero=1, micro_batch_size=1)
    os.environ["TENAX_CKPT_FAULT"] = "stage-late"  # the thread writer copies only at the fence
    out = {}
    for writer in writers:
        spec = ckpt_spec(f"file://{root}/{writer}")
        trainer = Trainer(spec, layout)
        trainer.run_step()
        at_save = full_state(trainer)
        with CheckpointManager(checkpoint_config(spec), trainer, rank, world, writer=writer,
                               timeout_s=60) as mgr:
            mgr.save(1)
            trainer.run_step()  # these steps change every tensor while the write goes on
            trainer.run_step()
            event = mgr.wait()
        fresh = Trainer(spec, layout)
        with CheckpointManager(checkpoint_config(spec), fresh, rank, world, timeout_s=60) as mgr:
            step = mgr.load()
        loaded, now = full_state(fresh), full_state(trainer)
        out[writer] = {"step": step, "event": event,
                       "max_diff": max((loaded[k] - v).abs().max().item()
                                       for k, v in at_save.items()),
                       "changed": max((now[k] - v).abs().max().item() for k, v in at_save.items())}
    return out


def rank_failure_job(rank: int, world: int, uri: str) -> dict[str, Any]:
    """dp2: rank 1's write of step 2 fails as on a full disk; steps 1 and 3 must commit."""
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = ckpt_spec(uri)
    trainer = Trainer(spec, ParallelLayout(dp=2, zero=1, micro_batch_size=1))
    events = []
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, writer="thread",
                           timeout_s=60) as mgr:
        for step in (1, 2, 3):
            trainer.run_step()
            os.environ["TENAX_CKPT_FAULT"] = "fail" if step == 2 else ""
            os.environ["TENAX_CKPT_FAULT_RANKS"] = "1"
            mgr.save(step)
            mgr.wait()
            events += mgr.drain_events()
    return {"events": events, "step": trainer.step}
