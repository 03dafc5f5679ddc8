"""Per-rank jobs for the in-memory snapshot tests (importable by spawned ranks)."""
from __future__ import annotations

from typing import Any

from tenax.workers.checkpoint_config import checkpoint_config
from tests.ckpt_jobs import ckpt_spec, full_state


def snapshot_and_save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """dp2 ZeRO-1: one step, then a storage save and an in-memory snapshot of step 1 (sharing
    one plan, as in training); two more steps change every tensor while both copy. Returns the
    full state at step 1 (rank 0) and how many times the state was enumerated for a plan."""
    from tenax.checkpoint.collectives import all_ranks_agree
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.checkpoint.memory.snapshot import MemorySnapshotter
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = ckpt_spec(f"file://{root}/storage")
    trainer = Trainer(spec, ParallelLayout(dp=2, zero=1, micro_batch_size=1))
    trainer.run_step()
    at_save = full_state(trainer)
    done: list[dict[str, Any]] = []
    enumerated: list[int] = []
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=60) as mgr:
        pieces_for_save = mgr.state.pieces_for_save
        mgr.state.pieces_for_save = lambda: enumerated.append(1) or pieces_for_save()
        snaps = MemorySnapshotter(mgr.config, mgr.state, rank, world, f"{root}/snap-{rank}", 7,
                                  all_ranks_agree, done.append, plans=mgr.plans)
        mgr.save(1)
        snaps.snapshot(1)
        trainer.run_step()
        trainer.run_step()
        snaps.close()
        mgr.wait()
    return {"at_save": at_save if rank == 0 else None, "done": done, "planned": len(enumerated)}


def load_both_job(rank: int, world: int, storage_uri: str, memory_uri: str) -> dict[str, Any]:
    """Load step 1 into tp2 from storage, then from the assembled snapshot; full states."""
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = ckpt_spec(storage_uri)
    out: dict[str, Any] = {}
    for name, source in (("storage", None), ("memory", memory_uri)):
        trainer = Trainer(spec, ParallelLayout(tp=2, micro_batch_size=1))
        with CheckpointManager(checkpoint_config(spec), trainer, rank, world,
                               timeout_s=60) as mgr:
            step = mgr.load(source_uri=source)
            events = mgr.drain_events()
        out[name] = {"step": step, "state": full_state(trainer),
                     "cursor": trainer.loader.state_dict()["samples_consumed"],
                     "source": [e.get("source") for e in events
                                if e["event"] == "checkpoint_loaded"]}
    return out if rank == 0 else {}


def _save_bytes(planned: Any) -> dict[str, Any]:
    from tenax.checkpoint.tensor_bytes import byte_view

    return {"file": planned.file, "metadata": planned.metadata_bytes,
            "pieces": [(off, bytes(byte_view(t.contiguous()))) for off, t in planned.tensors]}


def reused_plan_job(rank: int, world: int, root: str, layout: dict[str, Any]) -> dict[str, Any]:
    """Per step, a save planned with the cached plan (reused while the state's identity holds)
    vs one planned from scratch: byte for byte the same, including right after the optimizer
    created its state and after a load replaced every moment."""
    from tenax.checkpoint.collectives import all_ranks_agree
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.checkpoint.save.planning import plan_save
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = ckpt_spec(f"file://{root}/storage")
    trainer = Trainer(spec, ParallelLayout.from_dict(layout))
    cache, mismatches, fast, enumerated = None, [], 0, []
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=60) as mgr:
        pieces_for_save = mgr.state.pieces_for_save  # counts the plans made from scratch
        mgr.state.pieces_for_save = lambda: enumerated.append(1) or pieces_for_save()
        for step in range(1, 6):
            if step == 4:
                mgr.save(3)
                mgr.wait()
                mgr.load()  # every moment replaced by the loaded copy
            else:
                trainer.run_step()
            before = len(enumerated)
            reused, cache = plan_save(mgr.state, rank, cache, all_ranks_agree)
            fast += len(enumerated) == before
            fresh, _ = plan_save(mgr.state, rank, None, all_ranks_agree)
            if _save_bytes(reused) != _save_bytes(fresh):
                mismatches.append(step)
    return {"mismatches": mismatches, "fast": fast}


def handed_plan_job(rank: int, world: int, root: str, layout: dict[str, Any]) -> dict[str, Any]:
    """A plan handed to a fresh SavePlans as a restarted process gets it from its agent (JSON,
    checkpoint/save/plan_codec.py): reused, and byte for byte what a fresh plan writes; mixed with a
    plan of another round on one rank, planned anew on every rank."""
    from tenax.checkpoint.collectives import all_ranks_agree
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.checkpoint.save.plan_codec import decode_plan, encode_plan
    from tenax.checkpoint.save.planning import SavePlans, plan_save
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = ckpt_spec(f"file://{root}/storage")
    trainer = Trainer(spec, ParallelLayout.from_dict(layout))
    trainer.run_step()
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=60) as mgr:
        blobs: list[str] = []
        mgr.plans.on_new_plan = lambda cache: blobs.append(encode_plan(cache, rank, world))
        mgr.plans.plan(mgr.state, rank, all_ranks_agree)  # from scratch: handed over
        made = mgr.plans.cache
        decoded = decode_plan(blobs[0], rank, world)
        same = [getattr(decoded, f) == getattr(made, f) for f in
                ("local_items", "final_items", "offsets", "file", "nbytes", "metadata_bytes",
                 "token")]
        trainer.run_step()
        restarted = SavePlans()
        restarted.adopt(decoded)
        handed = restarted.plan(mgr.state, rank, all_ranks_agree)
        fresh, other_round = plan_save(mgr.state, rank, None, all_ranks_agree)
        mixed = SavePlans()
        mixed.adopt(decode_plan(blobs[0], rank, world) if rank == 0 else other_round)
        mixed_plan = mixed.plan(mgr.state, rank, all_ranks_agree)
    return {"roundtrip": same, "blobs": len(blobs), "blob_bytes": len(blobs[0]),
            "handed_reused": handed.reused_plan,
            "handed_equal": _save_bytes(handed) == _save_bytes(fresh),
            "mixed_reused": mixed_plan.reused_plan,
            "mixed_equal": _save_bytes(mixed_plan) == _save_bytes(fresh)}


def not_ready_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """A save one rank is not ready for (a snapshot whose replica is still on its way): no
    rank plans it; once every rank is ready the cached plan serves, with the agreed step."""
    from tenax.checkpoint.collectives import all_ranks_agree
    from tenax.checkpoint.manager import CheckpointManager
    from tenax.checkpoint.save.planning import STEP_KEY
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = ckpt_spec(f"file://{root}/storage")
    trainer = Trainer(spec, ParallelLayout(dp=2, zero=1, micro_batch_size=1))
    trainer.run_step()
    enumerated: list[int] = []
    with CheckpointManager(checkpoint_config(spec), trainer, rank, world, timeout_s=60) as mgr:
        pieces_for_save = mgr.state.pieces_for_save
        mgr.state.pieces_for_save = lambda: enumerated.append(1) or pieces_for_save()
        first = mgr.plans.plan(mgr.state, rank, all_ranks_agree)  # from scratch
        trainer.run_step()
        refused = [mgr.plans.plan(mgr.state, rank, all_ranks_agree, ready=ready) is None
                   for ready in (rank == 0, rank == 1, False)]
        ready = mgr.plans.plan(mgr.state, rank, all_ranks_agree, ready=True)
        steps = [float(t) for item, (_, t) in zip(mgr.plans.cache.final_items, ready.tensors)
                 if item.index.fqn == STEP_KEY]  # held by one rank (a save dedups it)
    return {"first_reused": first.reused_plan, "refused": refused,
            "reused": ready.reused_plan, "planned": len(enumerated), "steps": steps}
