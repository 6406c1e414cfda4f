"""The Qwen2.5-VL adapter: TESTA in the vision tower of `Qwen2_5_VLForConditionalGeneration` / `Qwen2_5_VLModel`.

What is patched (instances only, through ``common.patch_of(model)``; `remove_testa` restores each attribute exactly):

* the base model's ``get_video_features``: the tower with TESTA (`video_llms.qwen_tower.run_tower`), one
  ``(tokens, out_hidden_size)`` tensor per video, ``tokens`` = the schedule's ``slices' x units'``;
* the base model's ``get_rope_index`` (`mrope_index`, shared with Qwen3-VL): M-RoPE positions of the video tokens from
  the units' centroids ``(tubelet t, row, column)``: ``(floor(t * tokens_per_second * second_per_grid_t), round(row),
  round(column))`` plus the stock offset; images and text exactly as the stock method (text after a video continues at
  the stock offset, ``max(h, w) / 2`` past the video's start). ``generate`` asks for positions *before* it runs the
  tower (``_prepare_position_ids_for_generation``, with the pixels among its arguments): the tower then runs there and
  its features are kept until the prefill's ``get_video_features`` takes them (same pixel tensor, unchanged), so it runs
  once. A forward pass computes the features first and the positions from them;
* the processor's ``replace_video_token``: ``slices' x units'`` placeholders per video, from the schedule
  (`video_llms.common.token_grid`), known before the tower runs.

Images go through the stock tower and positions.
"""

import itertools
import weakref

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .common import GEOMETRY_MERGE_ONLY, InstancePatch, patch_of, token_grid
from .qwen_tower import run_tower


def _class_names(model) -> set[str]:
    return {cls.__name__ for cls in type(model).__mro__}


def video_token_counts(settings, grid_thw) -> list[int]:
    """Video tokens the LLM gets for every ``(t, h, w)`` row of ``grid_thw`` (patches; 2x2 units per token)."""
    counts = []
    for t, h, w in (tuple(int(v) for v in row) for row in grid_thw):
        slices, units = token_grid(settings, t, h * w // 4)
        counts.append(slices * units)
    return counts


class QwenVideoAdapter:
    """What Qwen2.5-VL and Qwen3-VL share: the base model, the feature cache between positions and prefill, the
    processor's placeholder count. Subclasses name the classes and run the tower."""

    classes: tuple[str, ...] = ()
    base_class = ""
    allowed_settings = GEOMETRY_MERGE_ONLY
    settings_defaults: dict = {}
    options: tuple[str, ...] = ("chunk_frames", "chunk_offload")

    def supports(self, model) -> bool:
        return bool(_class_names(model) & set(self.classes))

    def base_model(self, model):
        """The ``*Model`` instance that owns ``visual``, ``get_video_features`` and ``get_rope_index``."""
        return model if self.base_class in _class_names(model) else model.model

    def num_blocks(self, model) -> int:
        return len(self.base_model(model).visual.blocks)

    def check(self, model) -> None:
        visual = self.base_model(model).visual
        self.chunk_slices(visual, patch_of(model).chunk_frames)
        if visual.spatial_merge_size != 2:
            raise ValueError(
                f"TESTA merges Qwen's 2x2 merger units; this tower has spatial_merge_size={visual.spatial_merge_size}."
            )

    # -- the tower ----------------------------------------------------------------------------------------------------

    def encode(self, base, pixel_values, grid_thw, settings, chunk_frames: int | None = None,
               chunk_offload: str | None = None):
        raise NotImplementedError

    @staticmethod
    def chunk_slices(visual, chunk_frames: int | None) -> int | None:
        """Tubelets per chunk for ``chunk_frames`` frames (a multiple of the tower's ``temporal_patch_size``, else
        ValueError); None: all at once."""
        if chunk_frames is None:
            return None
        frames = visual.config.temporal_patch_size
        if chunk_frames % frames:
            raise ValueError(f"chunk_frames={chunk_frames!r} must be a multiple of the tower's "
                             f"temporal_patch_size ({frames} frames per tubelet).")
        return chunk_frames // frames

    def features(self, patch: InstancePatch, base, pixel_values, grid_thw):
        """The tower's `VideoFeatures` per video: the ones `positions` computed for these very pixels (generate),
        else a fresh run. Records the positions for `get_rope_index`."""
        pending = patch.cache.pop("pending", None)
        if pending is not None and self._same_pixels(pending, pixel_values, grid_thw):
            videos = pending["videos"]
        else:
            videos = self.encode(base, pixel_values, grid_thw, patch.settings, patch.chunk_frames, patch.chunk_offload)
        self._record(patch, pixel_values, grid_thw, videos)
        return videos

    def positions(self, patch: InstancePatch, base, grid_thw, pixel_values=None) -> list[torch.Tensor]:
        """The centroids ``(tokens, 3)`` of every video's tokens: of the last encoded videos when they are these
        (the same pixel tensor, or, without pixels, the same grids: a forward pass encodes before its positions),
        else the tower runs now and keeps its features for the prefill."""
        recorded = patch.cache.get("positions")
        if recorded is not None and torch.equal(recorded["grid"], grid_thw.detach().cpu()) and (
                pixel_values is None or self._same_pixels(recorded, pixel_values, grid_thw)):
            return recorded["positions"]
        if pixel_values is None:
            raise ValueError(
                "The M-RoPE positions of TESTA-reduced video tokens depend on what the tower merged: call the model "
                "(or generate) with pixel_values_videos, or get_video_features first, before get_rope_index."
            )
        videos = self.encode(base, pixel_values, grid_thw, patch.settings, patch.chunk_frames, patch.chunk_offload)
        self._record(patch, pixel_values, grid_thw, videos)
        patch.cache["pending"] = {**patch.cache["positions"], "videos": videos}
        return patch.cache["positions"]["positions"]

    @staticmethod
    def _record(patch, pixel_values, grid_thw, videos) -> None:
        patch.cache["positions"] = {
            "pixels": weakref.ref(pixel_values), "version": pixel_values._version,
            "grad": torch.is_grad_enabled(), "grid": grid_thw.detach().cpu().clone(),
            "positions": [v.positions for v in videos],
        }

    @staticmethod
    def _same_pixels(entry, pixel_values, grid_thw) -> bool:
        return (entry["pixels"]() is pixel_values and entry["version"] == pixel_values._version
                and entry["grad"] == torch.is_grad_enabled() and torch.equal(entry["grid"], grid_thw.detach().cpu()))

    # -- patching -----------------------------------------------------------------------------------------------------

    def video_output(self, videos: list):
        """``get_video_features``' output (a `ModelOutput`) for the tower's `VideoFeatures` of the videos."""
        raise NotImplementedError

    @staticmethod
    def last_hidden_state(videos: list) -> torch.Tensor | None:
        """The videos' `VideoFeatures.last_hidden` one after the other (stock: the tower's last hidden states of
        all videos), None from a chunked run."""
        if not videos or any(v.last_hidden is None for v in videos):
            return None
        return torch.cat([v.last_hidden for v in videos])

    def video_positions(self, base, grid_thw, centroids: list[torch.Tensor], settings, device, **kwargs):
        """``video_positions(start, length)`` for :func:`mrope_index`: the M-RoPE positions of every run of video
        placeholders, in prompt order, from the centroids of the tower's tokens (``kwargs``: what
        ``get_rope_index`` got besides, e.g. ``second_per_grid_ts``)."""
        raise NotImplementedError

    def patch_processor(self, patch: InstancePatch, processor) -> None:
        raise NotImplementedError

    def apply(self, model, processor, settings) -> None:
        """Patches the base model's ``get_video_features`` and ``get_rope_index`` (and the processor's placeholder
        count) through ``patch_of(model)``."""
        self.check(model)
        patch, base, adapter = patch_of(model), self.base_model(model), self
        stock_rope_index = base.get_rope_index

        def get_video_features(self, pixel_values_videos, video_grid_thw=None, **kwargs):
            # as stock (`can_return_tuple`): a tuple when asked, by the call or by the config; the tower's hidden
            # states and attention weights per block are not kept (None), whatever `output_*` says
            return_dict = kwargs.get("return_dict")
            output = adapter.video_output(adapter.features(patch, self, pixel_values_videos, video_grid_thw))
            return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()

        def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                           attention_mask=None, **kwargs):
            if video_grid_thw is None:
                return stock_rope_index(input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw,
                                        attention_mask=attention_mask, **kwargs)
            centroids = adapter.positions(patch, self, video_grid_thw, kwargs.get("pixel_values_videos"))
            positions = adapter.video_positions(self, video_grid_thw, centroids, patch.settings, input_ids.device,
                                                **kwargs)
            return mrope_index(self, input_ids, mm_token_type_ids, image_grid_thw, attention_mask, positions)

        patch.replace_method(base, "get_video_features", get_video_features)
        patch.replace_method(base, "get_rope_index", get_rope_index)
        if processor is not None:
            self.patch_processor(patch, processor)


class Qwen2_5_VLAdapter(QwenVideoAdapter):
    """`Qwen2_5_VLForConditionalGeneration` and `Qwen2_5_VLModel` (and subclasses)."""

    classes = ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel")
    base_class = "Qwen2_5_VLModel"

    def encode(self, base, pixel_values, grid_thw, settings, chunk_frames: int | None = None,
               chunk_offload: str | None = None):
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as family

        visual = base.visual
        window = visual.window_size // visual.spatial_merge_size // visual.patch_size
        return run_tower(visual, pixel_values, grid_thw, settings, family, window=window,
                         full_attention_blocks=tuple(visual.fullatt_block_indexes),
                         chunk_slices=self.chunk_slices(visual, chunk_frames), chunk_offload=chunk_offload)

    def video_output(self, videos: list):
        return BaseModelOutputWithPooling(last_hidden_state=self.last_hidden_state(videos),
                                          pooler_output=tuple(v.features for v in videos))

    def video_positions(self, base, grid_thw, centroids, settings, device, second_per_grid_ts=None, **kwargs):
        """Every video's tokens at their centroids' positions (`video_rope_positions`), time at
        ``tokens_per_second * second_per_grid_t``."""
        tokens_per_second = base.config.vision_config.tokens_per_second
        videos = iter(zip(grid_thw, centroids))
        seconds = iter(second_per_grid_ts) if second_per_grid_ts is not None else itertools.repeat(1)

        def positions(start: int, length: int):
            grid, video_centroids = next(videos)
            check_placeholders("A video", length, video_centroids.shape[0])
            interval = tokens_per_second * next(seconds)
            return video_rope_positions(video_centroids.to(device), start, interval), grid

        return positions

    def patch_processor(self, patch: InstancePatch, processor) -> None:
        settings = patch.settings

        def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
            grid = video_inputs["video_grid_thw"][video_idx]
            return self.video_token * video_token_counts(settings, [grid])[0]

        patch.replace_method(processor, "replace_video_token", replace_video_token)


def video_rope_positions(centroids: torch.Tensor, start: int, time_interval) -> torch.Tensor:
    """``(3, tokens)`` M-RoPE positions of a video's tokens from their centroids ``(tokens, 3)`` (tubelet, row,
    column): time ``floor(t * time_interval)`` (as the stock ``(arange(t) * interval).long()``), row and column
    rounded to the nearest integer, all offset by ``start``. Integer centroids give the stock positions."""
    time = (centroids[:, 0] * time_interval).long()
    rows, cols = torch.round(centroids[:, 1]).long(), torch.round(centroids[:, 2]).long()
    return torch.stack([time, rows, cols]) + start


def mrope_index(base, input_ids, mm_token_type_ids, image_grid_thw, attention_mask, video_positions):
    """The M-RoPE loop of `Qwen2_5_VLModel.get_rope_index` / `Qwen3VLModel.get_rope_index` (transformers 5.x), with
    the positions of every run of video placeholders from ``video_positions(start, length) -> ((3, length) positions,
    its stock grid)``, called run by run in prompt order. Text counts up from the previous run's end; an image gets
    the stock positions; text after an image or video run continues ``max(h, w) / 2`` past the run's start."""
    spatial_merge_size = base.config.vision_config.spatial_merge_size
    position_ids = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype, device=input_ids.device)
    images = iter(image_grid_thw) if image_grid_thw is not None else None
    deltas = []
    for batch_index, ids in enumerate(input_ids):
        types = mm_token_type_ids[batch_index]
        if attention_mask is not None:
            keep = attention_mask[batch_index].bool()
            ids, types = ids[keep], types[keep]
        current, pieces = 0, []
        for modality, group in itertools.groupby(enumerate(types.tolist()), lambda x: x[1]):
            group = list(group)
            length = group[-1][0] + 1 - group[0][0]
            if modality == 0:
                pieces.append(torch.arange(length, device=input_ids.device).view(1, -1).expand(3, -1) + current)
                current += length
                continue
            if modality == 2:
                positions, grid = video_positions(current, length)
            else:
                grid = next(images)
                positions = base.get_vision_position_ids(current, grid, 1, spatial_merge_size, device=input_ids.device)
            pieces.append(positions)
            current += max(grid[1], grid[2]) // spatial_merge_size
        positions = torch.cat(pieces, dim=1).reshape(3, -1)
        if attention_mask is not None:
            position_ids[:, batch_index, attention_mask[batch_index].bool()] = positions.to(position_ids.device)
        else:
            position_ids[:, batch_index] = positions.to(position_ids.device)
        deltas.append(positions.max() + 1 - len(ids))
    return position_ids, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def check_placeholders(what: str, placeholders: int, tokens: int) -> None:
    """Raises a ValueError when a run of ``placeholders`` video placeholders does not hold the ``tokens`` the tower
    left (inputs from a processor that was not patched with the model)."""
    if placeholders != tokens:
        raise ValueError(
            f"{what} has {placeholders} placeholder tokens but TESTA leaves {tokens}: build the inputs with the "
            "processor passed to apply_testa (it emits the reduced count)."
        )


__all__ = ["Qwen2_5_VLAdapter", "QwenVideoAdapter", "check_placeholders", "mrope_index", "video_rope_positions",
           "video_token_counts"]
