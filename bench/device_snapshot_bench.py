"""What a per-step snapshot's device-to-host copy costs a training step, done as today and done
asynchronously (one of `gpu_check.sh`'s checks on a lent GPU, a smoke run on CPU).

    python -m bench.device_snapshot_bench [--device cuda|cpu] [--size smoke|gpu] [--steps N]
                                          [--reps R] [--json PATH] [--quick]

Why: on a GPU node the host's cores are free while the device computes, so the host-side part
of a snapshot (copying thread, agents, replica) costs training nothing measurable
(bench/overhead_bench.py --cores split). What is left is the first move, device to host.
`checkpoint/memory/snapshot.py` makes it with `.cpu()` on the training thread, which blocks it for
the whole transfer at every step. The candidate fix copies on a side stream into pinned host
buffers kept between steps, and makes the training stream, not the host, wait for that copy
before the next optimizer step (the state changes nowhere else). This measures both against
no copy, side by side on the same engine (bench/mfu_bench.EngineLoop, AdamW, one rank),
interleaved in blocks of `steps` steps:
- none: the step alone;
- blocking: after each step, every parameter and AdamW moment brought to host with `.cpu()`;
- async: the same tensors copied on a side stream into the pinned buffers, the optimizer's
  stream waiting on the copy's event (`Tensor.record_stream` keeps the allocator off them).
A step's time runs from its start to the end of its snapshot call, so the blocking copy counts
in full and the asynchronous one by whatever the device waited for it. The last asynchronous
copy is compared with a device-side clone taken at the same point: equal, or the fence is
wrong. On CPU there is no device copy: both copying modes clone on the training thread (the
smoke run only shows the script works). `--quick`: the smoke size, one block of one step per
mode (explicit flags win).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any, Callable

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and its optimizer state tensors (local shards of DTensors)."""
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for t in [p] + [v for v in optimizer.state.get(p, {}).values()
                            if isinstance(v, torch.Tensor)]:
                t = t.to_local() if hasattr(t, "to_local") else t
                out.append(t.detach())
    return out


class BlockingCopy:
    """What checkpoint/memory/snapshot.py does today: `.cpu()` on the training thread."""

    def after_step(self, tensors: list[torch.Tensor]) -> None:
        self.host = [t.cpu() if t.is_cuda else t.clone() for t in tensors]

    def before_update(self) -> None:
        pass


class AsyncCopy:
    """A side stream into pinned buffers; the training stream waits for it at the fence."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.buffers: list[torch.Tensor | None] | None = None
        self.event: Any = None

    def after_step(self, tensors: list[torch.Tensor]) -> None:
        if self.stream is None:
            self.host = [t.clone() for t in tensors]
            return
        if self.event is not None:
            self.event.synchronize()  # a copying thread would be done with the buffers by now
        if self.buffers is None:
            self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if t.is_cuda
                            else None for t in tensors]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for t, buf in zip(tensors, self.buffers):
                if buf is not None:
                    buf.copy_(t, non_blocking=True)
                    t.record_stream(self.stream)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def before_update(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def matches(self, reference: list[torch.Tensor]) -> bool:
        """Whether the last copy holds exactly `reference` (device clones taken with it)."""
        if self.stream is None:
            return all(torch.equal(h, r) for h, r in zip(self.host, reference))
        self.event.synchronize()
        return all(buf is None or torch.equal(buf, r.cpu())
                   for buf, r in zip(self.buffers, reference))


def timed_steps(loop: Any, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                mode: Any, first: int, steps: int) -> list[float]:
    times = []
    for step in range(first, first + steps):
        x, y = batch(step)
        t0 = time.perf_counter()
        loop.step(x, y)  # ends with the loss's .item(): the device is done with the step
        if mode is not None:
            mode.after_step(state_tensors(loop.optimizer))
        times.append(time.perf_counter() - t0)
    return times


def run(device: torch.device, size: str, steps: int, reps: int) -> dict[str, Any]:
    from bench.mfu_bench import SIZES, EngineLoop, model_config, synthetic_batch

    dims = SIZES[size]
    cfg = model_config(dims)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    loop = EngineLoop(cfg, device, autocast, dims["micro_batch"], dims["accum"], dp=1, zero=1)
    rows = dims["micro_batch"] * dims["accum"]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = synthetic_batch(rows, cfg.seq_len, cfg.vocab_size, 5, step % 8)
        return x.to(device), y.to(device)

    modes: dict[str, Any] = {"none": None, "blocking": BlockingCopy(), "async": AsyncCopy(device)}
    current: dict[str, Any] = {"mode": None}

    def fence(*_: Any) -> None:  # a pre-hook that returns something would replace the args
        if current["mode"] is not None:
            current["mode"].before_update()

    loop.optimizer.register_step_pre_hook(fence)
    timed_steps(loop, batch, None, 0, 2)  # warm-up: allocator, kernels, the moments' creation
    times: dict[str, list[float]] = {name: [] for name in modes}
    step = 2
    for _ in range(reps):
        for name, mode in modes.items():
            current["mode"] = mode
            times[name] += timed_steps(loop, batch, mode, step, steps)
            step += steps
    tensors = state_tensors(loop.optimizer)
    reference = [t.clone() for t in tensors]  # the state the next copy must hold
    modes["async"].after_step(tensors)
    current["mode"] = modes["async"]
    timed_steps(loop, batch, None, step, 1)  # the next step updates the state after the fence
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {"device": str(device), "size": size, "state_bytes": nbytes,
            "steps_per_block": steps, "reps": reps,
            "median_step_s": {k: statistics.median(v) for k, v in times.items()},
            "async_copy_exact": modes["async"].matches(reference)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=("smoke", "gpu"), default=None)
    parser.add_argument("--steps", type=int, default=None, help="per block (default 4)")
    parser.add_argument("--reps", type=int, default=None, help="blocks per mode (default 2)")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--quick", action="store_true", help="smoke size, 1 step, 1 rep")
    args = parser.parse_args(argv)
    quick = {"size": "smoke", "steps": 1, "reps": 1} if args.quick else {"steps": 4, "reps": 2}
    for name, value in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    logging.basicConfig(level=logging.WARNING)
    from bench.mfu_bench import one_rank_group

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    one_rank_group(device)
    result = run(device, args.size or ("gpu" if device.type == "cuda" else "smoke"),
                 args.steps, args.reps)
    med = result["median_step_s"]
    result["tokens_per_s_blocking_over_none"] = med["none"] / med["blocking"]
    result["tokens_per_s_async_over_none"] = med["none"] / med["async"]
    extra = med["blocking"] - med["none"]  # None where the copy is lost in the noise
    result["blocking_copy_gb_per_s"] = result["state_bytes"] / 1e9 / extra if extra > 0 else None
    print(json.dumps(result, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()
    return 0 if result["async_copy_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
