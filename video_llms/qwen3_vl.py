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

import numpy as np
import torch

from .common import InstancePatch, token_grid
from .qwen2_5_vl import QwenVideoAdapter, check_placeholders
from .qwen_tower import run_tower


def span_timestamps(timestamps: list[float], slices: int) -> list[float]:
    """The mean timestamp of each of ``slices`` contiguous near-equal spans of ``timestamps`` (``numpy.array_split``);
    ``slices == len(timestamps)`` returns them unchanged."""
    return [float(np.mean(span)) for span in np.array_split(np.asarray(timestamps, dtype=np.float64), slices)]


class Qwen3VLAdapter(QwenVideoAdapter):
    """`Qwen3VLForConditionalGeneration` and `Qwen3VLModel` (and subclasses)."""

    classes = ("Qwen3VLForConditionalGeneration", "Qwen3VLModel")
    base_class = "Qwen3VLModel"

    def encode(self, base, pixel_values, grid_thw, settings, chunk_frames: int | None = None,
               chunk_offload: str | None = None):
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
                         by_slice=True, chunk_slices=self.chunk_slices(visual, chunk_frames),
                         chunk_offload=chunk_offload)

    def video_output(self, videos: list):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        taps = len(videos[0].deepstack) if videos else 0
        return BaseModelOutputWithDeepstackFeatures(
            last_hidden_state=self.last_hidden_state(videos),
            pooler_output=tuple(v.features for v in videos),
            deepstack_features=[tuple(v.deepstack[tap] for v in videos) for tap in range(taps)],
        )

    def video_positions(self, base, grid_thw, centroids, settings, device, **kwargs):
        """One group of ``units'`` tokens per remaining tubelet (a run of placeholders each), at its tokens' rounded
        (row, column) centroids; time is carried by the text between the groups, as stock."""
        groups = []  # (grid of the stock group, centroids of its tokens), in prompt order
        for grid, video_centroids in zip(grid_thw, centroids):
            t, h, w = (int(v) for v in grid)
            units = token_grid(settings, t, h * w // 4)[1]
            groups.extend((grid, chunk) for chunk in video_centroids.split(units))
        runs = iter(groups)

        def positions(start: int, length: int):
            grid, chunk = next(runs)
            check_placeholders("A video frame group", length, chunk.shape[0])
            chunk = chunk.to(device)
            rows, cols = torch.round(chunk[:, 1]).long(), torch.round(chunk[:, 2]).long()
            return torch.stack([torch.zeros_like(rows), rows, cols]) + start, grid

        return positions

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


__all__ = ["Qwen3VLAdapter", "span_timestamps"]
