"""The Qwen3-VL adapter: TESTA in the vision tower of `Qwen3VLForConditionalGeneration` / `Qwen3VLModel`.

As for Qwen2.5-VL (`video_llms.qwen2_5_vl`), with what Qwen3-VL does differently:

* **The prompt has one group per tubelet**: ``<t seconds><|vision_start|>`` + one placeholder per unit +
  ``<|vision_end|>``. The patched processor emits ``slices'`` groups of ``units'`` placeholders (the schedule's
  grid). The tower's output comes slice by slice (`qwen_tower.slice_order`): remaining tubelets in the order of
  their size-weighted mean time, units within a tubelet by (row, column) centroid.
* **Timestamps.** Which tubelets merge depends on the video, but the prompt is written before the tower runs, so the
  ``k``-th group is labelled with the mean of the stock timestamps of the ``k``-th of ``slices'`` contiguous, near-equal
  spans of the video's tubelets (`span_timestamps`; ``numpy.array_split`` spans). With no temporal reduction they are
  the stock timestamps; with it, they are the times the remaining tubelets would have if the merges were even, not
  the measured centroids of the merged tubelets (their order is the same: both increase).
* **M-RoPE** (one ``(1, h, w)`` grid per group, time carried by the text between groups, as stock): a group's
  tokens get ``(start, start + round(row), start + round(column))`` from their centroids.
* **DeepStack**: the features tapped after blocks ``deepstack_visual_indexes`` (through their mergers, as stock) are
  merged by every later merge exactly as the tokens are and leave in the same order, so the LLM adds each to the
  token it belongs to.
"""

import itertools

import numpy as np
import torch

from .common import InstancePatch, patch_of, token_grid
from .qwen2_5_vl import QwenVideoAdapter
from .qwen_tower import run_tower


def span_timestamps(timestamps: list[float], slices: int) -> list[float]:
    """The mean timestamp of each of ``slices`` contiguous near-equal spans of ``timestamps`` (``numpy.array_split``);
    ``slices == len(timestamps)`` returns them unchanged."""
    return [float(np.mean(span)) for span in np.array_split(np.asarray(timestamps, dtype=np.float64), slices)]


class Qwen3VLAdapter(QwenVideoAdapter):
    """`Qwen3VLForConditionalGeneration` and `Qwen3VLModel` (and subclasses)."""

    classes = ("Qwen3VLForConditionalGeneration", "Qwen3VLModel")
    base_class = "Qwen3VLModel"

    def encode(self, base, pixel_values, grid_thw, settings, chunk_frames: int | None = None):
        from transformers.models.qwen3_vl import modeling_qwen3_vl as family
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        visual = base.visual

        def position_embedding(grid: torch.Tensor) -> torch.Tensor:  # as the stock tower, for any (videos, 3) grid
            indices, weights = get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
                align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size,
            )
            return (visual.pos_embed(indices) * weights[:, :, None]).sum(1)

        return run_tower(visual, pixel_values, grid_thw, settings, family,
                         deepstack_blocks=tuple(visual.deepstack_visual_indexes),
                         deepstack_mergers=visual.deepstack_merger_list, position_embedding=position_embedding,
                         by_slice=True, chunk_slices=self.chunk_slices(visual, chunk_frames))

    def apply(self, model, processor, settings) -> None:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        self.check(model)
        patch, base, adapter = patch_of(model), self.base_model(model), self
        stock_rope_index = base.get_rope_index

        def get_video_features(self, pixel_values_videos, video_grid_thw=None, **kwargs):
            videos = adapter.features(patch, self, pixel_values_videos, video_grid_thw)
            taps = len(videos[0].deepstack) if videos else 0
            return BaseModelOutputWithDeepstackFeatures(
                pooler_output=tuple(v.features for v in videos),
                deepstack_features=[tuple(v.deepstack[tap] for v in videos) for tap in range(taps)],
            )

        def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                           attention_mask=None, **kwargs):
            if video_grid_thw is None:
                return stock_rope_index(input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw,
                                        attention_mask=attention_mask, **kwargs)
            centroids = adapter.positions(patch, self, video_grid_thw, kwargs.get("pixel_values_videos"))
            return rope_index(self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, centroids,
                              patch.settings, attention_mask)

        patch.replace_method(base, "get_video_features", get_video_features)
        patch.replace_method(base, "get_rope_index", get_rope_index)
        if processor is not None:
            self.patch_processor(patch, processor)

    def patch_processor(self, patch: InstancePatch, processor) -> None:
        settings = patch.settings

        def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
            t, h, w = (int(v) for v in video_inputs["video_grid_thw"][video_idx])
            slices, units = token_grid(settings, t, h * w // 4)
            if "video_metadata" not in video_inputs:
                raise ValueError("The frame timestamps need the video metadata, `return_metadata=False` is not supported")
            metadata = video_inputs["video_metadata"][video_idx]
            metadata.fps = 24 if metadata.fps is None else metadata.fps  # the stock default (it warns there)
            stamps = self._calculate_timestamps(metadata.frames_indices, metadata.fps,
                                                self.video_processor.temporal_patch_size)
            group = self.vision_start_token + self.video_token * units + self.vision_end_token
            return "".join(f"<{stamp:.1f} seconds>" + group for stamp in span_timestamps(stamps[:t], slices))

        patch.replace_method(processor, "replace_video_token", replace_video_token)


def rope_index(base, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, centroids, settings,
               attention_mask):
    """`Qwen3VLModel.get_rope_index` (transformers 5.x) for TESTA-reduced videos: one group of ``units'`` tokens per
    remaining tubelet, each at its tokens' rounded (row, column) centroids; text and images as stock."""
    spatial_merge_size = base.config.vision_config.spatial_merge_size
    groups = []  # (grid of the stock group, centroids of its tokens), in prompt order
    for grid, video_centroids in zip(video_grid_thw, centroids):
        t, h, w = (int(v) for v in grid)
        slices, units = token_grid(settings, t, h * w // 4)
        for chunk in video_centroids.split(units):
            groups.append((grid, chunk))
    images = iter(image_grid_thw) if image_grid_thw is not None else None
    videos = iter(groups)
    position_ids = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype, device=input_ids.device)
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
                grid, chunk = next(videos)
                if chunk.shape[0] != length:
                    raise ValueError(
                        f"A video frame group has {length} placeholder tokens but TESTA leaves {chunk.shape[0]}: build "
                        "the inputs with the processor passed to apply_testa (it emits the reduced count)."
                    )
                chunk = chunk.to(input_ids.device)
                rows, cols = torch.round(chunk[:, 1]).long(), torch.round(chunk[:, 2]).long()
                pieces.append(torch.stack([torch.zeros_like(rows), rows, cols]) + current)
            else:
                grid = next(images)
                pieces.append(base.get_vision_position_ids(current, grid, 1, spatial_merge_size,
                                                           device=input_ids.device))
            current += max(grid[1], grid[2]) // spatial_merge_size
        positions = torch.cat(pieces, dim=1).reshape(3, -1)
        if attention_mask is not None:
            position_ids[:, batch_index, attention_mask[batch_index].bool()] = positions.to(position_ids.device)
        else:
            position_ids[:, batch_index] = positions.to(position_ids.device)
        deltas.append(positions.max() + 1 - len(ids))
    return position_ids, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


__all__ = ["Qwen3VLAdapter", "rope_index", "span_timestamps"]
