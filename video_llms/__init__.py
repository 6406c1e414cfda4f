"""TESTA inside the vision towers of the video-LLMs of transformers 5.x, training-free, on instances.

    from video_llms import apply_testa_to_video_llm, remove_testa_from_video_llm
    apply_testa_to_video_llm(model, processor, temporal_reduction=..., spatial_reduction=...)
    inputs = processor(text=..., videos=..., return_tensors="pt"); model.generate(**inputs)
    remove_testa_from_video_llm(model)   # model and processor exactly as they were

(`modeling_testa.apply_testa(model, processor=processor, ...)` / `remove_testa(model)` dispatch here for these
models.) ``temporal_reduction`` (R_T) and ``spatial_reduction`` (R_S) are per block of the vision tower, as
`apply_testa` takes them: an int for every block or one int per block; 0 everywhere leaves the model exact.

**Adapters.** One per model family, in :data:`ADAPTERS`; an adapter has ``supports(model) -> bool``,
``num_blocks(model) -> int`` (the tower's blocks, for the settings), what its tower allows and defaults to
(``allowed_settings``, ``settings_defaults``), the options it takes beside the settings (``options``, e.g.
``("chunk_frames",)``, kept on the patch state), all validated in one place (`common.adapter_settings`), and
``apply(model, processor, settings)``. `apply` patches instances only, through the :class:`common.InstancePatch` that
`apply_testa_to_video_llm` has put on the model before calling it (``common.patch_of(model)``:
``replace_method``/``replace_attribute``), so removing is ``patch_of(model).restore()`` for every family.
"""

from .common import STATE_ATTRIBUTE, InstancePatch, adapter_settings, patch_of, token_grid
from .qwen2_5_vl import Qwen2_5_VLAdapter
from .llava_onevision import LlavaOnevisionAdapter
from .qwen3_vl import Qwen3VLAdapter

ADAPTERS = (Qwen2_5_VLAdapter(), Qwen3VLAdapter(), LlavaOnevisionAdapter())
"""One adapter instance per supported family."""


def adapter_for(model):
    """The adapter that supports ``model``, or None."""
    return next((adapter for adapter in ADAPTERS if adapter.supports(model)), None)


def is_video_llm(model) -> bool:
    """Whether ``model`` is a video-LLM an adapter supports."""
    return adapter_for(model) is not None


def apply_testa_to_video_llm(model, processor=None, *, temporal_reduction=0, spatial_reduction=0, **options):
    """Makes ``model`` aggregate video tokens in its vision tower with TESTA and ``processor`` (the model's
    processor instance) emit the reduced number of video placeholders. Calling it again replaces the settings.

    Args:
        model: a model an adapter in :data:`ADAPTERS` supports; others raise ``TypeError``.
        processor: the processor whose outputs the model will get. Without it, the inputs must carry the reduced
            number of placeholders some other way (transformers raises "Video features and video tokens do not
            match" otherwise).
        temporal_reduction: R_T per block: tubelets / frames merged into their most similar ones.
        spatial_reduction: R_S per block: merge units (Qwen: 2x2 token groups) merged within every tubelet / frame.
        options: `apply_testa`'s other settings (``score_grid``, ``frame_matching``, ``aggregation_dims``, ...; None:
            the adapter's default) and the adapter's own options (``chunk_frames``; the Qwen towers also
            ``chunk_offload``, with ``chunk_frames``); what the adapter's tower cannot
            do raises ``ValueError`` naming the option and its allowed values (`common.adapter_settings`).

    Returns:
        ``model``, patched.
    """
    adapter = adapter_for(model)
    if adapter is None:
        raise TypeError(
            f"apply_testa_to_video_llm supports "
            f"{', '.join(name for adapter in ADAPTERS for name in adapter.classes)}; got {type(model).__name__}."
        )
    settings, adapter_options = adapter_settings(adapter, adapter.num_blocks(model), temporal_reduction,
                                                 spatial_reduction, **options)
    if patch_of(model) is not None:
        remove_testa_from_video_llm(model)
    model.__dict__[STATE_ATTRIBUTE] = InstancePatch(settings=settings, adapter=adapter, processor=processor,
                                                   **adapter_options)
    try:
        adapter.apply(model, processor, settings)
    except BaseException:
        remove_testa_from_video_llm(model)
        raise
    return model


def remove_testa_from_video_llm(model):
    """Undoes :func:`apply_testa_to_video_llm` on the model and its processor; an unpatched model is returned
    unchanged."""
    patch = patch_of(model)
    if patch is None:
        return model
    patch.restore()
    del model.__dict__[STATE_ATTRIBUTE]
    return model


__all__ = [
    "ADAPTERS",
    "adapter_for",
    "apply_testa_to_video_llm",
    "is_video_llm",
    "remove_testa_from_video_llm",
    "token_grid",
]
