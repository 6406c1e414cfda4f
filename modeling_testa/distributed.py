"""Collectives the losses and the evaluation need, as no-ops in a single process.

Everything here works without `torch.distributed` being initialised (one process): gathers return their input and
`raise_on_every_rank` raises the local error.
"""

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def world_size() -> int:
    """Number of processes in the default group (1 without `torch.distributed`)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without `torch.distributed`)."""
    return dist.get_rank() if world_size() > 1 else 0


def check_same_shape_on_all_ranks(tensor: torch.Tensor, name: str, dims: tuple[int, ...]) -> None:
    """Raises a `ValueError` (on every rank) when ``tensor.shape[d]`` for ``d in dims`` differs between processes."""
    if world_size() == 1:
        return
    local = torch.tensor([tensor.shape[d] for d in dims], device=tensor.device, dtype=torch.long)
    shapes = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(shapes, local)
    if any(not torch.equal(s, local) for s in shapes):
        raise ValueError(
            f"`{name}` must have the same size along dims {dims} on every process to be gathered for the global "
            f"contrastive/matching losses; got {[s.tolist() for s in shapes]}. Use the same per-process batch size "
            "and number of frames on every process."
        )


class PeerError(RuntimeError):
    """Another process raised (`raise_on_every_rank`), so this one stops too; the message quotes its error."""


def raise_on_every_rank(error: Exception | None, device: torch.device | None = None) -> None:
    """Collective (every process must call it at the same point): if any process passes an error, every process
    raises, so that no process is left waiting in the next collective. The failing process raises its own error; the
    others raise a `PeerError` (a `RuntimeError`) that quotes it."""
    if world_size() == 1:
        if error is not None:
            raise error
        return
    flags = torch.zeros(world_size(), dtype=torch.long, device=device)
    flags[rank()] = int(error is not None)
    dist.all_reduce(flags)
    if not bool(flags.any()):
        return
    messages = [None] * world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = {index: message for index, message in enumerate(messages) if message is not None}
    raise PeerError(f"another process raised, so every process stops: {failed}")


def broadcast_object(obj: Any, source: int = 0) -> Any:
    """Collective: process `source`'s `obj` on every process (picklable objects; `obj` itself in one process)."""
    if world_size() == 1:
        return obj
    holder = [obj if rank() == source else None]
    dist.broadcast_object_list(holder, src=source)
    return holder[0]


def gather_objects(obj: Any) -> list[Any]:
    """Collective: every process's `obj`, in rank order, on every process (``[obj]`` in one process)."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    """Collective: waits for every process (nothing in one process)."""
    if world_size() > 1:
        dist.barrier()


@torch.no_grad()
def gather_without_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenates ``tensor`` from all processes along dim 0 (rank order); no gradient flows back."""
    if world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def gather_padded(tensor: torch.Tensor, pad_value: int) -> torch.Tensor:
    """Like `gather_without_grad` for ``(batch, length)`` tensors whose length may differ between processes: every
    process's tensor is right-padded with ``pad_value`` to the longest one first."""
    if world_size() == 1:
        return tensor
    length = gather_without_grad(torch.tensor([tensor.shape[1]], device=tensor.device))
    tensor = F.pad(tensor, (0, int(length.max()) - tensor.shape[1]), value=pad_value)
    return gather_without_grad(tensor)


class _AllGatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0 that lets gradients flow back to every process's slice (BLIP's ``GatherLayer``).

    Each process's loss only sees its own rows, so the gradient of the summed losses with respect to the local slice
    is the sum over processes of the gradients they computed for it: backward all-reduces and keeps the local part.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        ctx.batch = tensor.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.batch
        return grad[start : start + ctx.batch]


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenates ``tensor`` from all processes along dim 0, with gradients flowing back to every slice."""
    return tensor if world_size() == 1 else _AllGatherWithGrad.apply(tensor)


__all__ = [
    "PeerError",
    "barrier",
    "broadcast_object",
    "check_same_shape_on_all_ranks",
    "gather_objects",
    "gather_padded",
    "gather_with_grad",
    "gather_without_grad",
    "raise_on_every_rank",
    "rank",
    "world_size",
]
