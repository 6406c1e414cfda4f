"""Hub export of TESTA models and pipelines: the one module that knows both.

The models save complete Hub repositories on their own (`TestaHubMixin`, in the neutral `saving`): weights,
config with `auto_map` and `custom_pipelines`, the code files of the models and of the pipelines, and a model card.
This module adds what needs the pipeline classes themselves:

- `PIPELINE_TASKS`: the tasks each model class serves, with the pipeline *classes* (the names written to
  `config.json["custom_pipelines"]` are checked against `pipeline_testa` when this module is imported, so a renamed
  pipeline cannot silently produce folders that fail to load);
- `save_for_hub`: a model (or a pipeline) and its processor saved into one folder, the card listing the processor's
  video settings.

Dependencies run one way (see `saving`): the models do not import the pipelines or this module; this module
imports both. It is not part of the exported remote code (nothing in a saved folder needs it).
"""

import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel
from transformers.pipelines.base import Pipeline

from .modeling_testa import TestaPreTrainedModel
from .pipeline_testa import PIPELINE_CLASSES
from .saving import (
    CUSTOM_PIPELINES,
    MODEL_CARD_MARKER,
    PIPELINE_MODULE,
    TestaHubMixin,
    custom_pipelines_for,
    model_card,
    push_folder_to_hub,
    write_model_card,
)


def _resolve_pipeline_tasks() -> dict[str, dict[str, dict[str, Any]]]:
    """`CUSTOM_PIPELINES` with the class names replaced by the pipeline classes (`pipeline_testa.PIPELINE_CLASSES`).
    Raises `ImportError` when a name is not the registered pipeline of its task, in `PIPELINE_MODULE`."""
    resolved: dict[str, dict[str, dict[str, Any]]] = {}
    for model_class, tasks in CUSTOM_PIPELINES.items():
        resolved[model_class] = {}
        for task, info in tasks.items():
            pipeline_class = PIPELINE_CLASSES.get(task)
            if (
                pipeline_class is None
                or pipeline_class.__name__ != info["impl"]
                or pipeline_class.__module__.split(".")[-1] != PIPELINE_MODULE
            ):
                raise ImportError(
                    f"custom_pipelines of {model_class} name {PIPELINE_MODULE}.{info['impl']} for {task!r}, which "
                    f"is not the registered pipeline of that task ({pipeline_class})."
                )
            resolved[model_class][task] = {**info, "impl": pipeline_class}
    return resolved


PIPELINE_TASKS: dict[str, dict[str, dict[str, Any]]] = _resolve_pipeline_tasks()
"""Pipeline tasks per model class: task -> `{"impl": <pipeline class>, "pt": [auto class names], "type"}`."""


def save_for_hub(
    obj: Any, save_directory: str | os.PathLike, processor: Any = None, repo_id: str | None = None, **kwargs: Any
) -> Path:
    """Saves a TESTA model (with `processor`) or a TESTA pipeline (with its own processor) as one Hub folder: the
    model's `save_pretrained` (weights, config, code, card), the processor, and the card again so that it lists the
    processor's video settings.

    Args:
        obj: a `TestaPreTrainedModel` or one of the TESTA pipelines.
        save_directory (`str` or `os.PathLike`): the folder (created if needed).
        processor (`TestaProcessor`, *optional*): saved next to a model; a pipeline saves its own.
        repo_id (`str`, *optional*): the repository name used in the card's usage snippet.
        **kwargs: passed to the model's `save_pretrained`.

    Returns:
        `Path`: the folder.
    """
    # Duck-typed, so that models and pipelines loaded as Hub remote code (other classes of the same code) work too.
    is_model = isinstance(obj, TestaPreTrainedModel) or (
        isinstance(obj, PreTrainedModel) and hasattr(obj, "write_model_card")
    )
    is_pipeline = isinstance(obj, Pipeline) and hasattr(getattr(obj, "model", None), "write_model_card")
    if is_model:
        obj.save_pretrained(save_directory, **kwargs)
        if processor is not None:
            processor.save_pretrained(save_directory)
        write_model_card(obj, save_directory, processor=processor, repo_id=repo_id)
    elif is_pipeline:
        if processor is not None:
            raise ValueError("A pipeline saves its own processor: pass `processor=None` with a pipeline.")
        obj.save_pretrained(save_directory, **kwargs)
        write_model_card(obj.model, save_directory, processor=obj.processor, repo_id=repo_id)
    else:
        raise TypeError(f"`obj` must be a TESTA model or a TESTA pipeline, got {type(obj).__name__}.")
    return Path(save_directory)


__all__ = [
    "MODEL_CARD_MARKER",
    "PIPELINE_TASKS",
    "TestaHubMixin",
    "custom_pipelines_for",
    "model_card",
    "push_folder_to_hub",
    "save_for_hub",
    "write_model_card",
]
