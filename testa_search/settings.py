"""What an index is built with, and the one check that a build may write into a home.

`IndexInfo` declares once the settings two builds of one index must share (the model, the frames, R_T/R_S, the
precision, the moments' window and stride, ...): a home refuses rows built with other settings, naming every
difference, before anything is encoded, and changes nothing. The model that searches an index must share the settings
read from its config (`IndexInfo.model_differences`).

A video store records its settings in ``index_settings.json`` when its first build starts, whoever builds it
(`VideoTextRetrievalPipeline.encode_videos(store_dir=...)`, `python -m train.index`, `VideoIndex.save`, the training
evaluation), so that any of them can grow or resume it. `check_store_folder` is the one check of a folder before a
store is written into it.
"""

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from testa_runtimes.fingerprints import weights_fingerprint
from testa_search.store.lock import LOCK_FILE
from testa_search.store.video_store import (PLAN_FILE, forget_rows, is_video_store, read_json_file, replace_file,
                                            store_metadata)

SETTINGS_FILE = "index_settings.json"
"""A store's settings, written when its first build starts (`check_store_folder`)."""


MODEL_KEYS = ("model_weights_sha256", "name_or_path", "model")
"""The settings that tell which model encoded an index: a store that records none of them cannot be grown."""
SCRATCH_KEY = "scratch"
"""Recorded by a build that replaces a store's rows (the training evaluation's): such a store is not grown."""


class IndexSettingsError(ValueError):
    """An index (or the folder meant for it) cannot take this build: other settings, or not an index at all.
    Attributes: ``location`` (the folder, file or collection) and ``differences`` (``{setting: (recorded, this
    build's)}``, empty when the refusal is not about settings)."""

    def __init__(self, location: str | os.PathLike, message: str,
                 differences: dict[str, tuple[Any, Any]] | None = None):
        self.location, self.differences = str(location), dict(differences or {})
        super().__init__(message)


def config_setting(read: Any) -> dict[str, Any]:
    """Field metadata: the setting is read from a model's config by ``read(config)``."""
    return {"config": read}


WHOLE_VIDEOS_IS_A_VALUE = {"none_is_a_value": True}
"""Field metadata: None is a recorded value (an index of whole videos has no window), compared like any other; every
index has always recorded it by leaving it out."""


def json_value(value: Any) -> Any:
    """`value` as it reads back from json (tuples become lists), so saved and fresh settings compare equal."""
    return json.loads(json.dumps(value))


@dataclass(frozen=True)
class IndexInfo:
    """The settings an index must share with another build to be grown by it, and (those read from the model's
    config) with the model that searches it: declared here once. Saved as an index's `info` (`as_dict`; a build may
    add keys of its own, e.g. `train.index`'s ``shard_size``, which are kept and not compared).

    A setting an index does not record (None) is not compared, except ``window`` and ``stride``, for which None means
    an index of whole videos. ``model`` and ``name_or_path`` (where the weights came from) are compared only when
    either side lacks ``model_weights_sha256``, which names the weights themselves.
    """

    model_class: str | None = None
    name_or_path: str | None = None
    model: str | None = None
    model_weights_sha256: str | None = None
    projection_dim: int | None = field(default=None, metadata=config_setting(lambda c: c.projection_dim))
    num_frames: int | None = None
    temporal_reduction: list[int] | None = field(
        default=None, metadata=config_setting(lambda c: c.vision_config.temporal_reduction_per_layer))
    spatial_reduction: list[int] | None = field(
        default=None, metadata=config_setting(lambda c: c.vision_config.spatial_reduction_per_layer))
    score_grid: float | None = field(default=None, metadata=config_setting(lambda c: c.vision_config.score_grid))
    precision: str | None = None
    token_dtype: str | None = None
    window: float | None = field(default=None, metadata=WHOLE_VIDEOS_IS_A_VALUE)
    stride: float | None = field(default=None, metadata=WHOLE_VIDEOS_IS_A_VALUE)

    @classmethod
    def from_model(cls, encoder: Any, num_frames: int, with_weights: bool = False, **settings: Any) -> "IndexInfo":
        """The settings of an index that the model `encoder` encodes at `num_frames` frames (`with_weights`: also
        hash its weights, about a second for ViT-B); `settings` sets the others (``model``, ``precision``, ...)."""
        config = encoder.config
        read = {f.name: json_value(f.metadata["config"](config)) for f in fields(cls) if "config" in f.metadata}
        return cls(model_class=type(encoder).__name__, name_or_path=getattr(config, "_name_or_path", None) or "",
                   num_frames=int(num_frames),
                   model_weights_sha256=weights_fingerprint(encoder) if with_weights else None, **read, **settings)

    @classmethod
    def from_dict(cls, info: dict[str, Any] | None) -> "IndexInfo":
        """The settings recorded in an index's `info` (other keys are ignored)."""
        info = info or {}
        return cls(**{f.name: json_value(info[f.name]) for f in fields(cls) if info.get(f.name) is not None})

    def as_dict(self) -> dict[str, Any]:
        """The recorded settings, json-ready."""
        return {f.name: json_value(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None}

    def differences(self, other: "IndexInfo") -> dict[str, tuple[Any, Any]]:
        """``{setting: (mine, theirs)}`` for every setting both record with different values (see the class)."""
        by_weights = self.model_weights_sha256 is not None and other.model_weights_sha256 is not None
        skipped = ("model", "name_or_path") if by_weights else ()
        differing = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            recorded = f.metadata.get("none_is_a_value") or (mine is not None and theirs is not None)
            if f.name not in skipped and recorded and json_value(mine) != json_value(theirs):
                differing[f.name] = (mine, theirs)
        return differing

    def model_differences(self, config: Any) -> dict[str, tuple[Any, Any]]:
        """``{setting: (recorded, the model's)}`` for the settings read from a model's config that differ."""
        return {f.name: (getattr(self, f.name), json_value(f.metadata["config"](config))) for f in fields(self)
                if "config" in f.metadata and getattr(self, f.name) is not None
                and json_value(getattr(self, f.name)) != json_value(f.metadata["config"](config))}


def settings_differences(recorded: dict[str, Any], build: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{setting: (recorded, this build's)}``: the one comparison of an index's recorded settings with a build's
    (`IndexInfo.differences`); keys `IndexInfo` does not declare are not compared."""
    return IndexInfo.from_dict(recorded).differences(IndexInfo.from_dict(build))


def describe_differences(differences: dict[str, tuple[Any, Any]]) -> str:
    """One line per setting: ``"  name: the index has A, this build B"``."""
    return "\n".join(f"  {key}: the index has {recorded!r}, this build {mine!r}"
                     for key, (recorded, mine) in differences.items())


def check_settings(location: str | os.PathLike, recorded: dict[str, Any], build: dict[str, Any]) -> None:
    """Raises `IndexSettingsError` naming `location` (a folder, quoted; or words such as ``"The index"``) and every
    setting in which `build` differs from `recorded`."""
    differences = settings_differences(recorded, build)
    if differences:
        name = repr(str(location)) if isinstance(location, Path) else str(location)
        raise IndexSettingsError(
            location, f"{name} was built with other settings, so nothing was written to it; build it with the same "
                      f"settings, or use another index:\n{describe_differences(differences)}", differences)


def recorded_store_settings(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The settings a store in `directory` records: its ``index_settings.json``, else (a store finished before that
    file existed) its index's `info` and token dtype (``{}`` when its info is empty: the settings are unknown); None
    for a folder without a store."""
    directory = Path(directory)
    if (directory / SETTINGS_FILE).is_file():
        return dict(read_json_file(directory / SETTINGS_FILE))  # DamagedStoreError naming it when damaged
    if is_video_store(directory):
        meta = store_metadata(directory)
        info = {key: value for key, value in (meta.get("info") or {}).items() if key != "segments"}
        return {**info, "token_dtype": meta["token_dtype"]} if info else {}
    return None


def check_store_folder(directory: str | os.PathLike, settings: dict[str, Any], replace: bool = False
                       ) -> dict[str, Any]:
    """The one check of a folder before a store is written into it; call it holding the store's lock. Returns the
    settings the store holds from now on.

    - A new or empty folder: `settings` are recorded (``index_settings.json``).
    - A store (`replace` False): its recorded settings must equal `settings` (`check_settings`; a setting this build
      leaves unset, e.g. ``token_dtype``, takes the store's); the recorded ones are returned, with the build's keys
      the store did not record added (written with the next plan, `StoreHome.plan`; nothing is written here).
    - With `replace` (the training evaluation's scratch store): a scratch store, or a store that records no model (an
      earlier evaluation's), forgets its rows (`video_store.forget_rows`); `settings` are recorded.
    - Anything else (a non-empty folder that holds no store, a store whose model is unknown, a store that is not a
      scratch store for `replace`): refused.

    Raises `IndexSettingsError` naming the folder; nothing in it changes then."""
    directory = Path(directory)
    recorded = recorded_store_settings(directory)
    if recorded is not None and not replace:
        if recorded.get(SCRATCH_KEY):
            raise IndexSettingsError(directory, f"{str(directory)!r} holds a training evaluation's scratch store "
                                                "(rewritten by every evaluation), so it cannot be grown: use a new "
                                                "folder.")
        if not any(recorded.get(key) for key in MODEL_KEYS):
            raise IndexSettingsError(directory, f"{str(directory)!r} holds a video store that does not record which "
                                                "model encoded it (an earlier evaluation's store), so it cannot be "
                                                "grown: use a new folder.")
        check_settings(directory, recorded, settings)
        return {**settings, **recorded}
    if recorded is not None and not recorded.get(SCRATCH_KEY) and any(recorded.get(key) for key in MODEL_KEYS):
        raise IndexSettingsError(directory, f"{str(directory)!r} holds a video store: an evaluation's scratch store "
                                            "rewrites its folder, so give it a new or empty one.")
    if directory.exists() and not directory.is_dir():
        raise IndexSettingsError(directory, f"{str(directory)!r} is a file; give a folder for the store.")
    others = sorted(p.name for p in directory.iterdir() if p.name != LOCK_FILE) if directory.is_dir() else []
    planned = (directory / PLAN_FILE).is_file()
    if others and not (replace and (recorded is not None or planned)):
        what = "an unfinished video store whose settings are unknown" if planned else "files that are not a video store"
        raise IndexSettingsError(directory, f"{str(directory)!r} holds {what} ({', '.join(others[:5])}"
                                            f"{', ...' if len(others) > 5 else ''}): give a new or empty folder.")
    directory.mkdir(parents=True, exist_ok=True)
    forget_rows(directory)  # a replaced store's rows
    settings = {**settings, SCRATCH_KEY: True} if replace else dict(settings)
    write_json_atomically(directory / SETTINGS_FILE, settings)
    return settings


def write_json_atomically(path: Path, value: Any) -> None:
    """Writes `value` to a temporary file and renames it: a reader sees the old file or the new one."""
    replace_file(Path(path), json.dumps(value, indent=1))


__all__ = ["MODEL_KEYS", "SCRATCH_KEY", "SETTINGS_FILE", "IndexInfo", "IndexSettingsError", "check_settings", "check_store_folder",
           "config_setting", "describe_differences", "json_value", "recorded_store_settings", "settings_differences",
           "weights_fingerprint", "write_json_atomically"]
