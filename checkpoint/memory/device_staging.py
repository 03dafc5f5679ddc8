"""DeviceStaging: a snapshot's device tensors copied to host memory without stopping training.

Why: a `.cpu()` per tensor blocks the training thread for the whole device-to-host transfer, at
every snapshot (15 GB of fp32 weights and AdamW moments is of the order of a second at pageable
rates). Here the copies run on a side stream into one pinned host buffer kept between
snapshots, so the transfer runs at the link's full rate and overlaps the next step's forward
and backward, which only read the state. The state changes only inside the next
`optimizer.step()`; its fence makes the *device* wait for the copy (`fence`: the optimizer's
stream waits on the copy's event), never the host. The copying thread reads the buffer only
after `wait()` (the event has completed), so what it checksums is what the copy brought.

The buffer is one flat allocation of the plan's file size: the pieces lie in it at their planned
offsets as bytes (any dtype, any alignment). It is reused while the size holds, so it must not
be written again while the copying thread still reads it: the snapshotter takes no new snapshot
while the last one is still being copied (every rank agrees to skip it instead).

Host tensors of a device state (a step counter) are cloned on the training thread: they are
tiny, and a clone needs no host-side fence.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

Pieces = list[tuple[int, torch.Tensor]]  # (offset in the file, tensor)


def on_device(pieces: Pieces) -> bool:
    """Whether any piece lives in accelerator memory (then it is staged here)."""
    return any(t.device.type == "cuda" for _, t in pieces)


class DeviceStaging:
    """One rank's pinned staging buffer, side stream and the last copy's event."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # flat uint8, pinned
        self.stream: Any = None
        self.event: Any = None
        self.device: torch.device | None = None

    def stage(self, pieces: Pieces) -> Pieces:
        """Start copying `pieces` to host; returns the host pieces the copying thread writes
        once `wait()` returned. Called on the training thread after the step's last kernel
        was enqueued (the copy is ordered after it)."""
        device = next(t.device for _, t in pieces if t.device.type == "cuda")
        size = max((off + t.numel() * t.element_size() for off, t in pieces), default=0)
        self._prepare(device, size)
        host: Pieces = []
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            for off, t in pieces:
                if t.device.type != "cuda":
                    host.append((off, t.detach().clone()))
                    continue
                nbytes = t.numel() * t.element_size()
                target = self.buffer[off:off + nbytes]
                source = t.detach()
                if not source.is_contiguous():
                    source = source.contiguous()
                target.copy_(source.reshape(-1).view(torch.uint8), non_blocking=True)
                # The allocator must not hand this memory to another tensor before the copy
                t.record_stream(self.stream)
                host.append((off, target))
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        return host

    def _prepare(self, device: torch.device, size: int) -> None:
        if self.stream is None or self.device != device:
            self.device, self.stream = device, torch.cuda.Stream(device)
        if self.buffer is None or self.buffer.numel() != size:
            self.buffer = None  # the old one goes before the new one is taken
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            logger.info("snapshot staging: %d bytes of pinned host memory for %s", size, device)

    def fence(self) -> None:
        """Before the optimizer changes the state: its stream waits for the copy (the host
        does not)."""
        if self.event is not None and self.device is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def wait(self) -> None:
        """Until the copy has landed in host memory (the copying thread calls it)."""
        if self.event is not None:
            self.event.synchronize()

    @property
    def active(self) -> bool:
        """Whether a copy was ever started (the state is in device memory)."""
        return self.event is not None

    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def close(self) -> None:
        self.wait()
        self.buffer = self.event = None
