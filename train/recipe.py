"""The training recipe, typed: every key a recipe may hold, its type and its default, declared once.

A recipe is a YAML file from ``configuration/`` (see configuration/README.md) with five sections: ``task``,
``model`` (the keywords of `TestaConfig`, whose defaults are the config's, plus ``init_from``), ``data``, ``train``
and ``eval``. :func:`load_recipe` reads one, applies the command-line overrides (``--set section.key=value``, values
parsed as YAML) and returns a :class:`Recipe`, whose sections are the dataclasses :class:`DataRecipe`,
:class:`TrainRecipe` and :class:`EvalRecipe`: a key the recipe leaves out takes the default written there (and
nowhere else), a key that nothing reads raises (naming the file, the section and the allowed keys), and a value of
the wrong type or outside the allowed ones raises (naming the key, the value and what is allowed).

A few defaults depend on the task (`TASK_DEFAULTS`): pretraining streams its data, reads 30-token captions and
evaluates only when the recipe names an evaluation split.
"""

import argparse
import copy
import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


TASKS = ("retrieval", "qa", "pretrain")
SCHEDULERS = ("cosine", "linear", "constant")
MIXED_PRECISIONS = ("auto", "no", "fp16", "bf16", "fp8")
SAMPLINGS = ("uniform", "headtail", "random")


@dataclass(frozen=True)
class DataRecipe:
    """``data``: where the rows come from and how videos and texts become tensors."""

    dataset: str | list[str] | None = None  # a folder of our jsonl/parquet files, a Hub id, or a list of them
    train_split: str = "train"
    eval_split: str | None = "test"  # None: no evaluation split
    streaming: bool = False
    shuffle_buffer: int = 1000  # rows, for streamed data
    num_frames: int = 32
    sampling: str = "random"  # training frame sampling: one of SAMPLINGS
    image_size: int = 224
    max_text_length: int = 64  # tokens, captions / paragraphs
    max_question_length: int = 35
    max_answer_length: int = 10
    num_workers: int = 2  # DataLoader workers per process (decoding), training and evaluation
    video_backend: str = "auto"
    isolate_decoder: bool = True

    CHOICES = {"sampling": SAMPLINGS}


@dataclass(frozen=True)
class TrainRecipe:
    """``train``: optimisation. Batch sizes are global (summed over processes and accumulation steps)."""

    lr: float = 1e-5
    min_lr: float = 0.0  # reached at max_steps
    warmup_start_lr: float = 0.0
    scheduler: str = "cosine"  # after the warm-up: one of SCHEDULERS
    warmup_ratio: float = 0.0  # of max_steps, used when warmup_steps is not set
    warmup_steps: int | None = None
    weight_decay: float = 0.05
    epochs: int = 1
    max_steps: int | None = None  # optimiser steps; overrides epochs
    batch_size: int = 16
    grad_accum: int = 1
    max_grad_norm: float | None = None  # None or 0: no clipping
    mixed_precision: str | None = None  # None or "auto": the launch configuration decides
    gradient_checkpointing: bool = False
    find_unused_parameters: bool | None = None  # None: only in joint mode (its temporal attention is unused)
    seed: int = 42
    save_every: int = 0  # optimiser steps between save_state checkpoints; 0: none
    keep_checkpoints: int | None = 2  # the most recent checkpoints kept (older ones are deleted); null: all
    log_every: int = 1
    reservoir_size: int = 8  # recent good samples kept to replace undecodable videos
    collective_timeout: float = 600.0  # seconds a process waits for the others in a collective, then fails

    CHOICES = {"scheduler": SCHEDULERS, "mixed_precision": MIXED_PRECISIONS}


@dataclass(frozen=True)
class EvalRecipe:
    """``eval``: the evaluation after training (two-stage retrieval, or QA answer ranking)."""

    k_test: int = 128  # candidates re-ranked by the matching head
    batch_size: int = 8  # global
    store_dir: str | None = None  # where the encoded test videos go; None: a temporary folder

    CHOICES = {}


SECTIONS: dict[str, type] = {"data": DataRecipe, "train": TrainRecipe, "eval": EvalRecipe}
"""The typed sections of a recipe (``model`` is checked against `TestaConfig`'s fields)."""

TASK_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "pretrain": {"data": {"streaming": True, "max_text_length": 30, "eval_split": None}},
}
"""Defaults that differ by task, over the sections' own."""

RECIPE_KEYS: dict[str, set[str]] = {name: {f.name for f in fields(cls)} for name, cls in SECTIONS.items()}
"""The keys of every typed section (derived from the dataclasses)."""


@dataclass(frozen=True)
class Recipe:
    """A parsed, validated recipe. ``model`` is the `TestaConfig` keywords (with ``vision_config`` /
    ``text_config`` mappings) plus ``init_from``; the other sections are typed.

    ``recipe[section]`` and ``recipe.get(section)`` give a section as a plain dict (defaults filled in), for code
    written against the dict form of a recipe (the evaluation, the tasks' hooks)."""

    task: str | None = None
    model: dict = field(default_factory=dict)
    data: DataRecipe = DataRecipe()
    train: TrainRecipe = TrainRecipe()
    eval: EvalRecipe = EvalRecipe()

    @property
    def init_from(self) -> str | None:
        return self.model.get("init_from")

    def model_settings(self) -> dict:
        """The `TestaConfig` keywords (a copy, without ``init_from``)."""
        settings = copy.deepcopy(self.model)
        settings.pop("init_from", None)
        return settings

    def to_dict(self) -> dict:
        """The recipe as the YAML's structure, every default filled in."""
        result: dict[str, Any] = {"task": self.task, "model": copy.deepcopy(self.model)}
        for name in SECTIONS:
            result[name] = dataclasses.asdict(getattr(self, name))
        return result

    def __getitem__(self, section: str):
        if section not in ("task", "model", *SECTIONS):
            raise KeyError(section)
        value = getattr(self, section)
        if dataclasses.is_dataclass(value):
            return dataclasses.asdict(value)
        return copy.deepcopy(value)

    def get(self, section: str, default=None):
        try:
            return self[section]
        except KeyError:
            return default


# ----------------------------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------------------------


def _allows_none(annotation) -> bool:
    return isinstance(annotation, types.UnionType) and type(None) in typing.get_args(annotation)


def _base_types(annotation) -> tuple:
    if isinstance(annotation, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def coerce(value, annotation, where: str):
    """``value`` as the declared type, or a `ValueError` naming ``where`` (``file: section.key``). Numbers may come as
    strings (YAML reads ``1e-5`` without a dot as a string); booleans must be booleans."""
    kinds = _base_types(annotation)
    expected = " or ".join(getattr(k, "__name__", str(k)) for k in kinds) + (" or null" if _allows_none(annotation)
                                                                              else "")
    for kind in kinds:
        origin = typing.get_origin(kind) or kind
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and not isinstance(value, bool):
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str):
                try:
                    return int(value)
                except ValueError:
                    pass
        if origin is float and not isinstance(value, bool):
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        if origin is str and isinstance(value, str):
            return value
        if origin is list and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
    raise ValueError(f"{where}={value!r}: expected {expected}")


def parse_section(cls: type, values: Mapping | None, section: str, source: str, defaults: Mapping | None = None):
    """One typed section from its mapping: unknown keys, wrong types and values outside ``cls.CHOICES`` raise. A key
    given as null keeps None where the type allows it, else takes the default."""
    values = dict(values or {})
    declared = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(declared))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown} in {section}; allowed keys are {sorted(declared)}")
    settings = dict(defaults or {})
    for name, value in values.items():
        annotation = declared[name].type
        if value is None:
            if _allows_none(annotation):
                settings[name] = None
            else:
                settings.pop(name, None)
            continue
        settings[name] = coerce(value, annotation, f"{source}: {section}.{name}")
    for name, allowed in cls.CHOICES.items():
        value = settings.get(name, declared[name].default)
        if value is not None and value not in allowed:
            raise ValueError(f"{source}: {section}.{name}={value!r}; allowed values are {list(allowed)}"
                             + (" or null" if _allows_none(declared[name].type) else ""))
    return cls(**settings)


def _config_fields(config_class) -> set[str]:
    return set(config_class().to_dict())


def check_model_section(model: Mapping, source: str) -> None:
    """Raises a `ValueError` naming the file and the allowed keys for a ``model`` key that `TestaConfig` (or its
    vision / text config) does not have."""
    from transformers import BlipTextConfig

    from modeling_testa import TestaConfig, TestaVisionConfig

    def check(keys, allowed, where: str) -> None:
        unknown = sorted(set(keys) - set(allowed))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown} in {where}; allowed keys are {sorted(allowed)}")

    check(model, {"init_from"} | _config_fields(TestaConfig), "model (TestaConfig keywords + init_from)")
    for name, config_class in (("vision_config", TestaVisionConfig), ("text_config", BlipTextConfig)):
        sub = model.get(name)
        if sub is not None and not isinstance(sub, Mapping):
            raise ValueError(f"{source}: model.{name} must be a mapping, got {sub!r}")
        check(sub or {}, _config_fields(config_class), f"model.{name}")


def parse_recipe(raw: Mapping, source: str, task: str | None = None) -> Recipe:
    """A :class:`Recipe` from the YAML's mapping. ``task`` (the script's) picks the task defaults when the recipe
    does not name its task. Raises a `ValueError` naming ``source`` for anything a recipe may not hold."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: a recipe is a mapping with sections task, model, data, train, eval")
    unknown = sorted(set(raw) - {"task", "model", *SECTIONS})
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown} in the recipe's top level; allowed keys are "
                         f"{sorted({'task', 'model', *SECTIONS})}")
    if raw.get("task") is not None and raw["task"] not in TASKS:
        raise ValueError(f"{source}: task={raw['task']!r}; allowed values are {list(TASKS)}")
    for section in ("model", *SECTIONS):
        if raw.get(section) is not None and not isinstance(raw[section], Mapping):
            raise ValueError(f"{source}: section {section!r} must be a mapping, got {raw[section]!r}")
    model = copy.deepcopy(dict(raw.get("model") or {}))
    check_model_section(model, source)
    defaults = TASK_DEFAULTS.get(raw.get("task") or task, {})
    sections = {name: parse_section(cls, raw.get(name), name, source, defaults.get(name))
                for name, cls in SECTIONS.items()}
    return Recipe(task=raw.get("task"), model=model, **sections)


def validate_recipe(recipe: Mapping, source: str) -> None:
    """Raises a `ValueError` naming the file, the section and the allowed keys (or values) for anything a recipe may
    not hold (`parse_recipe` without its result)."""
    parse_recipe(recipe, source)


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The training scripts' command line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="YAML recipe from configuration/")
    parser.add_argument("--dataset", help="overrides data.dataset: a folder of our jsonl/parquet files or a Hub id")
    parser.add_argument("--output-dir", default="outputs/run", help="checkpoints, logs and OUTPUT/final")
    parser.add_argument("--max-steps", type=int, help="overrides train.max_steps (optimiser steps)")
    parser.add_argument("--resume-from", help="a checkpoint folder written by save_state (OUTPUT/checkpoints/...)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an --output-dir that holds a previous run: its checkpoints, final model, "
                             "metrics and logs are deleted first (without it, such a folder is refused)")
    parser.add_argument("--init-from", help="overrides model.init_from")
    parser.add_argument("--strict-data", action="store_true",
                        help="stop on the first video that fails to decode (default: replace it from a reservoir of "
                             "recent good samples and count it)")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any recipe value, e.g. --set train.lr=1e-4 --set model.vision_config.temporal_reduction=2",
    )
    return parser.parse_args(argv)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``KEY=VALUE`` items applied to the recipe's mapping (in place; values parsed as YAML, sections created)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a section of the recipe")
        node[leaf] = yaml.safe_load(value)
    return raw


def load_recipe(args: argparse.Namespace, task: str | None = None) -> Recipe:
    """Reads the YAML recipe, applies the command-line overrides and parses the result (`parse_recipe`): a misspelt
    or unsupported key raises instead of being ignored."""
    path = Path(args.config)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {str(path)!r} does not exist; see configuration/ for the shipped ones")
    raw = yaml.safe_load(path.read_text()) or {}
    parse_recipe(raw, str(path), task)  # the file itself is valid
    overrides = list(args.set)
    for flag, key in (("dataset", "data.dataset"), ("max_steps", "train.max_steps"), ("init_from", "model.init_from")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    apply_overrides(raw, overrides)
    return parse_recipe(raw, f"{path} with the command-line overrides", task)


def as_recipe(recipe: "Recipe | Mapping", source: str = "recipe") -> Recipe:
    """A :class:`Recipe` as it is, or one parsed from a (possibly partial) mapping, e.g. ``{"data": {...}}``."""
    return recipe if isinstance(recipe, Recipe) else parse_recipe(recipe, source)


def as_train_recipe(train: "TrainRecipe | Mapping") -> TrainRecipe:
    """A :class:`TrainRecipe` as it is, or one parsed from a (possibly partial) ``train`` mapping."""
    return train if isinstance(train, TrainRecipe) else parse_section(TrainRecipe, train, "train", "recipe")


__all__ = [
    "MIXED_PRECISIONS",
    "RECIPE_KEYS",
    "SAMPLINGS",
    "SCHEDULERS",
    "SECTIONS",
    "TASKS",
    "TASK_DEFAULTS",
    "DataRecipe",
    "EvalRecipe",
    "Recipe",
    "TrainRecipe",
    "apply_overrides",
    "as_recipe",
    "as_train_recipe",
    "check_model_section",
    "coerce",
    "load_recipe",
    "parse_args",
    "parse_recipe",
    "parse_section",
    "validate_recipe",
]
