"""Where the engine's tensors live: the device check at start-up and host-to-device copies."""

from __future__ import annotations

from pathlib import Path

import torch


def check_device(device: str) -> None:
    """Refuse, loudly, an engine device that cannot work here: ``cuda`` without a usable GPU
    (no driver, one too old for this torch, or none visible)."""
    if torch.device(device).type != "cuda" or torch.cuda.is_available():
        return
    seen = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
    raise RuntimeError(
        f"device {device!r}: torch {torch.__version__} (CUDA {torch.version.cuda}) finds no "
        f"usable GPU" + (f", though {', '.join(seen)} exist: is the driver older than this "
                         f"CUDA needs?" if seen else "") + "; use device cpu or auto")


def to_device(values: list, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``: on a GPU through pinned memory, without waiting
    (a step's only sync is reading its sampled tokens)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def wait_for_writes(device: str | torch.device) -> None:
    """Block until every kernel queued so far on ``device`` has run: an explicit CUDA event
    recorded on the current stream and waited on. KV blocks are offered to another process
    (NIXL reads GPU memory outside torch's streams) only after this. A no-op on a CPU."""
    if torch.device(device).type != "cuda":
        return
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
