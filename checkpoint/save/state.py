"""What the manager saves and loads: state providers, and host staging for the thread writer.

Why separate from the manager: the manager only needs four calls from a trainer (tensors to
save, tensors to load into, apply what was loaded, describe layout/cursor/seed), so anything
that can answer them — a Trainer through `TrainerState`, or a test's dict of tensors — can be
checkpointed. `Stager` keeps the host copies a background writer reads from; it reuses them
across saves (pinned memory on GPUs) so staging costs one memcpy, not an allocation.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Protocol

import torch

from tenax.checkpoint.errors import StateProviderError, describe_error
from tenax.checkpoint.tensor_bytes import byte_view

logger = logging.getLogger(__name__)


class StateProvider(Protocol):
    """What the manager needs from a trainer; `TrainerState` adapts
    `tenax.workers.trainer.Trainer`."""

    step: int

    def state_for_save(self) -> dict[str, torch.Tensor]: ...

    def state_for_load(self) -> dict[str, torch.Tensor]: ...

    def apply_loaded(self, tensors: dict[str, torch.Tensor], *, step: int,
                     data_cursor: int) -> None: ...

    def describe(self) -> dict[str, Any]: ...  # layout, parallel, data_cursor, seed


class TrainerState:
    """A Trainer as a StateProvider: layout-free tensors from tenax.checkpoint.load.reshard."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def step(self) -> int:
        return self.trainer.step

    def state_for_save(self) -> dict[str, torch.Tensor]:
        from tenax.checkpoint.load.reshard import training_state

        return training_state(self.trainer)

    def pieces_for_save(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Like state_for_save, but ZeRO-1/2 moments as this rank's pieces (no gather)."""
        from tenax.checkpoint.save.pieces import save_state

        return save_state(self.trainer)

    def save_fingerprint(self) -> tuple[tuple[Any, ...], torch.Tensor]:
        """Identity of the tensors a save reads, and the step count (checkpoint/save/pieces.py)."""
        from tenax.checkpoint.save.pieces import state_fingerprint

        return state_fingerprint(self.trainer)

    def fence_before_update(self, wait: Callable[[], None]) -> Any:
        """Call `wait` before the next optimizer step; returns a handle with remove().

        The trainer changes parameters and moments only inside optimizer.step() (ZeRO-1/2
        shards are views of the parameters; their all-gather follows the step), so a copy
        that finishes before that call is a consistent snapshot.
        """
        return self.trainer.optimizer.register_step_pre_hook(lambda *_: wait())

    def state_for_load(self) -> dict[str, torch.Tensor]:
        from tenax.checkpoint.load.reshard import training_state

        return training_state(self.trainer, for_load=True)

    def apply_loaded(self, tensors: dict[str, torch.Tensor], *, step: int,
                     data_cursor: int) -> None:
        from tenax.checkpoint.load.reshard import apply_training_state

        apply_training_state(self.trainer, tensors)
        self.trainer.step = step  # the LR schedule is a pure function of the step
        self.trainer.loader.load_state_dict({"samples_consumed": data_cursor})

    def describe(self) -> dict[str, Any]:
        t = self.trainer
        return {"layout": t.layout.degrees(), "parallel": t.layout.to_dict(),
                "data_cursor": int(t.loader.state_dict()["samples_consumed"]),
                **t.checkpoint_facts()}  # seed and spec: the spec travels with the checkpoint


def manifest_fields(state: Any, job: str, model_hash: str) -> dict[str, Any]:
    """What a manifest records of the state a save (or an in-memory snapshot) holds now."""
    from tenax.checkpoint.format.metadata_codec import FORMAT

    d = state.describe()
    return {"layout": d["layout"], "model_hash": model_hash, "data_cursor": d["data_cursor"],
            "seed": d["seed"], "lr_step": state.step,
            "extra": {"format": FORMAT, "parallel": d.get("parallel", {}), "job": job,
                      **({"spec": d["spec"]} if d.get("spec") is not None else {})}}


def as_state_provider(obj: Any) -> StateProvider:
    if hasattr(obj, "pm") and hasattr(obj, "optimizer") and hasattr(obj, "loader"):
        return TrainerState(obj)
    needed = ("state_for_save", "state_for_load", "apply_loaded", "describe", "step")
    missing = [n for n in needed if not hasattr(obj, n)]
    if missing:
        raise StateProviderError(f"{type(obj).__name__} is neither a Trainer nor a state provider "
                              f"(missing {missing})")
    return obj


class Stager:
    """Host copies of the tensors for the thread writer, reused across saves (pinned on GPU)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def buffers_for(self, tensors: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        for i, (_, t) in enumerate(tensors):
            buf = self._buffers[i] if i < len(self._buffers) else None
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                self._buffers[i:i + 1] = [torch.empty(t.shape, dtype=t.dtype,
                                                      pin_memory=t.is_cuda)]
        del self._buffers[len(tensors):]
        return list(self._buffers)

    def stage(self, tensors: list[tuple[int, torch.Tensor]]) -> list[tuple[int, Any]]:
        """Copy everything now, on the calling thread."""
        staging = self.shared(tensors)
        staging.help()
        return staging.pieces()

    def shared(self, tensors: list[tuple[int, torch.Tensor]]) -> "SharedStaging":
        return SharedStaging(tensors, self.buffers_for(tensors))

    def clear(self) -> None:
        self._buffers = []


class SharedStaging:
    """A copy of many tensors that any number of threads can help finish.

    Why: a low-priority writer thread copies while cores are idle (ranks waiting in
    collectives); at the next optimizer step the training thread copies whatever is left at
    full speed instead of waiting, so training never loses more than a blocking copy would.
    `torch.Tensor.copy_` releases the GIL, so helpers run in parallel.
    """

    def __init__(self, tensors: list[tuple[int, torch.Tensor]],
                 buffers: list[torch.Tensor]) -> None:
        self._tensors, self._buffers = tensors, buffers
        self._lock = threading.Lock()
        self._next = self._finished = 0
        self._done = threading.Event()
        self.error: str | None = None
        if not tensors:
            self._done.set()

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= len(self._tensors) or self.error is not None:
                return None
            self._next += 1
            return self._next - 1

    def help(self) -> None:
        """Copy tensors until none is left to take (others may still be copying theirs)."""
        while (i := self._take()) is not None:
            t = self._tensors[i][1]
            try:
                self._buffers[i].copy_(t.detach(), non_blocking=t.is_cuda)
                if t.is_cuda:
                    torch.cuda.current_stream(t.device).synchronize()
            except Exception as exc:
                self.error = describe_error(exc)
                self._done.set()
                return
            with self._lock:
                self._finished += 1
                if self._finished == len(self._tensors):
                    self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """True once every tensor is copied (or an error stopped the copy)."""
        return self._done.wait(max(0.0, timeout_s))

    def pieces(self) -> list[tuple[int, Any]]:
        if self.error is not None or not self._done.is_set():
            raise RuntimeError(f"staging incomplete: {self.error or 'still copying'}")
        return [(offset, byte_view(buf)) for (offset, _), buf in zip(self._tensors, self._buffers)]
