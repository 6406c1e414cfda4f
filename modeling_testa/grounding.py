"""Text grounding on aggregated regions (the paper's Figure 4).

Every output token of the encoder is a *region*: the set of input patches (across the frames it merged) that ended in
it. `ground_phrases` embeds each phrase with the text encoder + `text_proj` (the VTC text embedding) and each region
with `vision_proj` (the VTC video projection applied to the region's token), and returns their cosine similarities;
`draw_grounding` paints them back onto the frames as a heat map through the source map.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from .visualization import displayable_frames, video_pixel_values, vision_encoder

if TYPE_CHECKING:  # Pillow is imported when drawing
    import PIL.Image


@dataclass
class Grounding:
    """Result of `ground_phrases`.

    Attributes:
        phrases: the phrases, in order.
        similarity: ``(phrases, regions)`` cosine similarity of every phrase with every region (output token, CLS
            excluded).
        source_map: ``(frames, patches)``: the region of every input patch (-1 where pruned).
        frames: ``(frames, height, width, 3)`` uint8 frames for drawing.
        patch_grid: ``(rows, columns)`` of patches per frame.
    """

    phrases: list[str]
    similarity: torch.Tensor
    source_map: torch.Tensor
    frames: np.ndarray
    patch_grid: tuple[int, int]

    def best_regions(self) -> list[int]:
        """The most similar region of every phrase."""
        return self.similarity.argmax(dim=1).tolist()

    def patch_similarity(self) -> torch.Tensor:
        """``(phrases, frames, patches)``: each input patch gets its region's similarity (NaN where pruned)."""
        index = self.source_map.clamp(min=0)
        values = self.similarity[:, index]
        return values.masked_fill(self.source_map.unsqueeze(0) < 0, float("nan"))


@torch.no_grad()
def ground_phrases(model, processor, video: Any, phrases: list[str]) -> Grounding:
    """Similarity of every phrase with every aggregated region of `video`.

    Args:
        model: a `TestaForVideoTextRetrieval` (or any model with `vision_model`, `vision_proj`, `get_text_features`).
        processor: a `TestaProcessor` (its tokenizer embeds the phrases, its video processor decodes the video).
        video: a path or decoded frames (given to the processor), or a float tensor of already-normalised
            `pixel_values`, ``(frames, 3, H, W)`` or ``(1, frames, 3, H, W)``.
        phrases: non-empty list of phrases.
    """
    if not isinstance(phrases, (list, tuple)) or not phrases or not all(isinstance(p, str) for p in phrases):
        raise ValueError(f"`phrases` must be a non-empty list of strings, got {phrases!r}")
    for name in ("vision_proj", "get_text_features"):
        if not hasattr(model, name):
            raise TypeError(f"ground_phrases needs a retrieval model with `{name}`; got {type(model).__name__}")
    encoder = vision_encoder(model)
    if isinstance(video, torch.Tensor) and video.is_floating_point() and video.ndim in (4, 5):
        pixel_values = video if video.ndim == 5 else video[None]  # already normalised pixel values
    else:
        pixel_values = video_pixel_values(getattr(processor, "video_processor", processor), video)
    device = next(model.parameters()).device
    out = encoder(pixel_values.to(device), trace_source=True)
    regions = F.normalize(model.vision_proj(out.last_hidden_state[0, 1:]), dim=-1)
    tokens = processor.tokenizer(list(phrases), padding=True, return_tensors="pt").to(device)
    text = model.get_text_features(tokens["input_ids"], tokens["attention_mask"])
    text = getattr(text, "pooler_output", text)  # the remote code of older saved folders returns the tensor
    side = int(round(out.source_map.shape[-1] ** 0.5))
    return Grounding(
        phrases=list(phrases), similarity=(text @ regions.T).float().cpu(), source_map=out.source_map[0].cpu(),
        frames=_uint8_frames(displayable_frames(pixel_values, processor)), patch_grid=(side, side),
    )


def _uint8_frames(frames: torch.Tensor) -> np.ndarray:
    """``(T, 3, H, W)`` floats in [0, 1] -> ``(T, H, W, 3)`` uint8 for drawing."""
    return (frames.permute(0, 2, 3, 1).numpy() * 255).astype(np.uint8)


def draw_grounding(grounding: Grounding, alpha: float = 0.55) -> "PIL.Image.Image":
    """One row per phrase: the frames with every patch tinted by its region's similarity (red = high, per-phrase
    min-max scaled); the best region of the phrase is outlined in white."""
    from PIL import Image, ImageDraw  # when drawing: the package imports without Pillow

    frames = grounding.frames
    count, height, width = frames.shape[:3]
    rows, columns = grounding.patch_grid
    label = 16
    canvas = Image.new("RGB", (count * (width + 4), len(grounding.phrases) * (height + label + 4)), "white")
    draw = ImageDraw.Draw(canvas)
    patch_values = grounding.patch_similarity()
    for p, phrase in enumerate(grounding.phrases):
        values = patch_values[p]
        finite = values[~torch.isnan(values)]
        low, high = (finite.min().item(), finite.max().item()) if finite.numel() else (0.0, 1.0)
        scaled = ((values - low) / max(high - low, 1e-6)).nan_to_num(0.0)
        best = grounding.best_regions()[p]
        top = p * (height + label + 4)
        draw.text((2, top + 2), f"{phrase!r}  best similarity {high:.3f}", fill="black")
        for t in range(count):
            heat = scaled[t].view(rows, columns).numpy()
            heat = np.kron(heat, np.ones((height // rows, width // columns)))
            tint = np.stack([heat * 255, heat * 60, (1 - heat) * 120], axis=-1)
            blended = (frames[t] * (1 - alpha) + tint[: frames.shape[1], : frames.shape[2]] * alpha).astype(np.uint8)
            left = t * (width + 4)
            canvas.paste(Image.fromarray(blended), (left, top + label))
            for patch in (grounding.source_map[t] == best).nonzero().flatten().tolist():
                r, c = divmod(patch, columns)
                box = (left + c * width // columns, top + label + r * height // rows,
                       left + (c + 1) * width // columns - 1, top + label + (r + 1) * height // rows - 1)
                draw.rectangle(box, outline="white", width=1)
    return canvas


__all__ = ["Grounding", "draw_grounding", "ground_phrases"]
