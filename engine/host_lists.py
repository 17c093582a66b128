"""Small host lists as device tensors, without making the host wait for the device."""
from __future__ import annotations

import torch


def on_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a tensor on `device`; to a GPU through pinned memory, without waiting for the work
    already queued there (a plain `torch.tensor(..., device=cuda)` waits for the stream: no overlap left)."""
    tensor = torch.tensor(values, dtype=dtype)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor
