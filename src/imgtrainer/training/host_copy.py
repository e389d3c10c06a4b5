"""Reading a device tensor late: copied to the host without waiting, read at a later point."""

from __future__ import annotations

import torch


class HostCopy:
    """A device tensor's value copied to host memory without waiting for the device (pinned
    memory and an event on CUDA), to be read later: at the next logging step, when the copy
    has long finished, so reading it does not stall the queue of work."""

    def __init__(self, like: torch.Tensor):
        self.cuda = like.device.type == "cuda"
        self.host = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending = False

    def start(self, value: torch.Tensor) -> None:
        self.host.copy_(value, non_blocking=True)
        if self.event is not None:
            self.event.record()
        self.pending = True

    def read(self) -> list | None:
        """The value last started (as a list), or None if none is pending."""
        if not self.pending:
            return None
        if self.event is not None:
            self.event.synchronize()
        self.pending = False
        return self.host.tolist()
