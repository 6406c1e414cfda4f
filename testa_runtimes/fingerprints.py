"""The SHA-256 of named tensors, written once: what an exported engine's cache is keyed by and what an index records
as the model that encoded it (`testa_search.settings`)."""

import hashlib
import weakref
from typing import Iterable

import torch


def tensor_fingerprint(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of named tensors (names, shapes, dtypes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        tensor = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()



FINGERPRINTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()
"""A model's last `weights_fingerprint`, with the version counters of its tensors then (a cache: any change to the
weights, an optimizer step or a load, bumps a counter)."""


ORIGINAL_WEIGHTS_ATTRIBUTE = "original_weights_sha256"
"""Set by `optimize_for_inference` (`name_converted_weights`): the fingerprint of the weights it was given, with the
version counters of the weights it converted them to."""


def _versions(state: list[tuple[str, torch.Tensor]]) -> tuple:
    return tuple((name, tensor._version, tensor.data_ptr()) for name, tensor in state)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers (names, shapes, dtypes and bytes); about a second for ViT-B, once
    per model and version of its weights. A model prepared by `optimize_for_inference` is named by the weights it was
    given, whatever the runtime converted them to (int8 linears, the text model's too with ``include_text``), as long
    as the converted weights are the ones it made: a load, a cast or an optimizer step afterwards makes the model
    hashed again (the precision, recorded beside the fingerprint, says how it computes)."""
    state = sorted(model.state_dict().items())
    versions = _versions(state)
    for known in (getattr(model, ORIGINAL_WEIGHTS_ATTRIBUTE, None), FINGERPRINTS.get(model)):
        if known is not None and known[0] == versions:
            return known[1]
    FINGERPRINTS[model] = (versions, tensor_fingerprint(state))
    return FINGERPRINTS[model][1]


def name_converted_weights(model: torch.nn.Module, original: str) -> None:
    """Records that `model`'s weights, as they are now (converted by a runtime), are named by `original`, the
    `weights_fingerprint` of the weights they were converted from."""
    setattr(model, ORIGINAL_WEIGHTS_ATTRIBUTE, (_versions(sorted(model.state_dict().items())), original))
