"""Pictures of TESTA's token aggregation, in the style of the paper's Figures 3 and 7.

"Frames that are enclosed within the same rectangle, as well as patches that share the same inner and border color,
are merged together." :func:`visualize_aggregation` draws the input frames on a grid and, from the encoder's source
tracking after a chosen block:

* outlines every group of **merged frames** with its own thick coloured rectangle (frames that stayed alone get a thin
  grey outline; frames whose patches were all pruned are drawn dark with a black outline);
* paints every group of **patches merged within a frame** with a translucent fill of the group's colour, and draws the
  group's outline in a darker shade of the same colour. Patches that are still alone keep their pixels. Patches that
  were pruned (``reduction_mode="prune"``) are darkened.

The colour of a patch group is that of its output token, so patches of merged frames that share a token (the same
patch position after a frame merge) also share a colour. With ``aggregation_dims="joint"`` (ToMe-style merging over
all space-time tokens) there is no frame-level merge: frames get no group rectangle, and a patch is painted whenever
its token holds other patches, of its own frame or of any other.

Only pillow is needed (no matplotlib), imported when drawing, so that the package imports without it. Imports are
sibling-relative so that the module works as Hub remote code.
"""

import colorsys
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # Pillow is imported when drawing
    import PIL.Image


# Strong, well separated colours for frame groups (matplotlib's tab10 without its grey), then golden-ratio hues.
_FRAME_PALETTE = [
    (214, 39, 40), (31, 119, 180), (44, 160, 44), (255, 127, 14), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207),
]
_SINGLE_FRAME_OUTLINE = (170, 170, 170)
_PRUNED_FRAME_OUTLINE = (0, 0, 0)
_BACKGROUND = (255, 255, 255)
_GOLDEN = 0.618033988749895


@dataclass
class AggregationGroups:
    """Which input frames and patches the encoder has merged after a given block.

    Attributes:
        pixels: ``(T0, 3, H, W)`` float frames in [0, 1], for drawing.
        source_map: ``(T0, h * w)`` long: for every input patch the flat index ``t * L + l`` of its token in the
            ``grid`` of tokens after the block, -1 when pruned.
        frame_groups: ``(T0,)`` long: the output frame every input frame ended in (-1: all its patches were pruned).
            Input frames with the same value were merged. In joint mode, ``arange(T0)`` (no frame-level merging).
        grid: ``(frames, patches per frame)`` of the token grid after the block (``(1, tokens)`` in joint mode).
        patch_grid: ``(h, w)``, the patches per input frame along height and width.
        layer: the (non-negative) index of the block after which the groups are taken.
        aggregation_dims: the encoder's ``config.aggregation_dims``.
    """

    pixels: torch.Tensor
    source_map: torch.Tensor
    frame_groups: torch.Tensor
    grid: tuple[int, int]
    patch_grid: tuple[int, int]
    layer: int
    aggregation_dims: str

    @property
    def num_tokens(self) -> int:
        """Patch tokens after the block (CLS excluded)."""
        return self.grid[0] * self.grid[1]


def vision_encoder(model: Any) -> Any:
    """The TESTA video encoder of ``model`` (itself, or its ``.vision_model``), checked by duck typing so that classes
    loaded as Hub remote code (a different class object than this package's) work too; a `TypeError` otherwise."""
    encoder = getattr(model, "vision_model", model)
    needed = ("run_blocks", "layers", "config")
    if not all(hasattr(encoder, name) for name in needed) or not hasattr(encoder.config, "aggregation_dims"):
        raise TypeError(
            f"`model` must be a TestaVisionModel or a model with a `.vision_model` TestaVisionModel; got "
            f"{type(model).__name__}."
        )
    return encoder


def _normalised_layer(layer: int, num_layers: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int) or not -num_layers <= layer < num_layers:
        raise ValueError(
            f"`layer` must be an int in [{-num_layers}, {num_layers - 1}] for an encoder with {num_layers} blocks "
            f"(-1 = after the last block); got {layer!r}."
        )
    return layer % num_layers


def _find_stat(processor: Any, name: str) -> Any:
    """``image_mean`` / ``image_std`` of a video processor, or of the video/image processor inside a processor."""
    for holder in (processor, getattr(processor, "video_processor", None), getattr(processor, "image_processor", None)):
        value = getattr(holder, name, None) if holder is not None else None
        if value is not None:
            return value
    return None


def _as_channel_stat(value: Any, name: str, channels: int) -> torch.Tensor:
    stat = torch.as_tensor(value, dtype=torch.float32).flatten()
    if stat.numel() == 1:
        stat = stat.expand(channels)
    if stat.numel() != channels:
        raise ValueError(f"`{name}` must have 1 or {channels} values, got {stat.tolist()}.")
    return stat.view(1, channels, 1, 1)


def video_pixel_values(processor: Any, video: Any, processor_kwargs: dict | None = None) -> torch.Tensor:
    """The ``(1, T, C, H, W)`` model input of one video.

    Args:
        processor: a callable video processor (``processor(videos=[video], return_tensors="pt", **processor_kwargs)``
            must return one video's ``pixel_values``), or ``None`` when ``video`` already is normalised pixel values.
        video: what the processor accepts (a path, decoded frames); without a processor a float array/tensor
            ``(T, C, H, W)`` or ``(1, T, C, H, W)``.
        processor_kwargs (`dict`, *optional*): extra arguments of the processor call (e.g. ``{"num_frames": 8}``).

    Raises:
        `TypeError`/`ValueError` naming ``processor`` or ``video`` when they do not give one video's pixel values.
    """
    if processor is not None:
        if not callable(processor):
            raise TypeError(
                "`processor` must be callable as processor(videos=..., return_tensors='pt'); got "
                f"{type(processor).__name__}."
            )
        output = processor(videos=[video], return_tensors="pt", **(processor_kwargs or {}))
        pixel_values = output["pixel_values"]
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 5 or pixel_values.shape[0] != 1:
            shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values)
            raise ValueError(
                f"`processor(videos=[video], return_tensors='pt')['pixel_values']` must be a (1, frames, channels, "
                f"height, width) tensor for one video; got {shape}."
            )
        return pixel_values
    if isinstance(video, np.ndarray):
        video = torch.from_numpy(video)
    if not isinstance(video, torch.Tensor) or not video.is_floating_point():
        raise TypeError(
            "Without a processor `video` must be a float pixel_values tensor of shape (frames, channels, height, "
            f"width) or (1, frames, channels, height, width); got {type(video).__name__}"
            + (f" of dtype {video.dtype}" if isinstance(video, torch.Tensor) else "")
            + ". Pass a processor to decode files or raw frames."
        )
    if video.ndim == 4:
        video = video.unsqueeze(0)
    if video.ndim != 5 or video.shape[0] != 1:
        raise ValueError(
            "Without a processor `video` must have shape (frames, channels, height, width) or (1, frames, channels, "
            f"height, width) (one video); got {tuple(video.shape)}."
        )
    return video


def displayable_frames(
    pixel_values: torch.Tensor, processor: Any = None, image_mean: Any = None, image_std: Any = None
) -> torch.Tensor:
    """The first video of normalised ``pixel_values`` ``(batch, T, C, H, W)`` as ``(T, 3, H, W)`` float frames in
    [0, 1] for drawing: the normalisation is undone with ``image_mean``/``image_std``, by default those of
    ``processor`` (or of its video/image processor). When they are unknown, one global stretch to [0, 1] keeps the
    hues. Grayscale frames are repeated to RGB, a fourth channel is dropped."""
    channels = pixel_values.shape[2]
    if processor is not None:
        image_mean = _find_stat(processor, "image_mean") if image_mean is None else image_mean
        image_std = _find_stat(processor, "image_std") if image_std is None else image_std
    pixels = pixel_values[0].detach().float().cpu()
    if image_mean is not None and image_std is not None:
        pixels = pixels * _as_channel_stat(image_std, "image_std", channels)
        pixels = pixels + _as_channel_stat(image_mean, "image_mean", channels)
    else:  # unknown normalisation: one global stretch to [0, 1], which keeps the hues
        low, high = pixels.min(), pixels.max()
        pixels = (pixels - low) / (high - low).clamp(min=1e-6)
    if channels == 1:
        pixels = pixels.expand(-1, 3, -1, -1)
    elif channels != 3:
        pixels = pixels[:, :3]
    return pixels.clamp(0, 1)


@torch.no_grad()
def trace_sources(model: Any, pixel_values: torch.Tensor, layer: int = -1) -> tuple[torch.Tensor, tuple[int, int]]:
    """Runs the encoder's embeddings and blocks ``0 .. layer`` with source tracking.

    Args:
        model: a TestaVisionModel or a model with a ``.vision_model`` one.
        pixel_values: ``(batch, frames, channels, height, width)``, normalised as the model expects.
        layer: the last block to run; negative values count from the end (-1: all blocks).

    Returns:
        ``source_map`` ``(batch, frames, patches)`` (flat token index in the grid after ``layer``, -1 = pruned) and that
        grid ``(frames, patches per frame)``.
    """
    encoder = vision_encoder(model)
    layer = _normalised_layer(layer, len(encoder.layers))
    encoder.check_pixel_values(pixel_values)
    was_training = encoder.training
    encoder.eval()
    try:
        device = next(encoder.parameters()).device
        settings = encoder.aggregation_settings(trace_source=True)
        tokens = encoder.run_blocks(pixel_values.to(device), settings, last_layer=layer)
    finally:
        encoder.train(was_training)
    return tokens.source_map.cpu(), (tokens.patches.shape[1], tokens.patches.shape[2])


def frame_groups_of(source_map: torch.Tensor, tokens_per_frame: int, joint: bool) -> torch.Tensor:
    """`AggregationGroups.frame_groups` of a ``(T0, h * w)`` source map into a grid of ``tokens_per_frame`` tokens per
    frame: every valid patch of an input frame lies in the same output frame (frames merge as a whole), -1 when all
    were pruned; in joint mode ``arange(T0)``."""
    if joint:
        return torch.arange(source_map.shape[0])
    return torch.where(source_map >= 0, source_map // tokens_per_frame, -1).max(dim=1).values


def aggregation_groups(
    model: Any,
    processor: Any,
    video: Any,
    layer: int = -1,
    image_mean: Any = None,
    image_std: Any = None,
    processor_kwargs: dict | None = None,
) -> AggregationGroups:
    """The frame and patch groups of ``video`` after block ``layer`` (see :func:`visualize_aggregation` for the
    arguments)."""
    encoder = vision_encoder(model)
    pixel_values = video_pixel_values(processor, video, processor_kwargs)
    source_map, grid = trace_sources(encoder, pixel_values, layer)
    source_map = source_map[0]
    height, width = pixel_values.shape[-2:]
    patch = encoder.config.patch_size
    pixels = displayable_frames(pixel_values, processor, image_mean, image_std)
    return AggregationGroups(
        pixels=pixels,
        source_map=source_map,
        frame_groups=frame_groups_of(source_map, grid[1], encoder.config.aggregation_dims == "joint"),
        grid=grid,
        patch_grid=(height // patch, width // patch),
        layer=_normalised_layer(layer, len(encoder.layers)),
        aggregation_dims=encoder.config.aggregation_dims,
    )


def _token_colour(token: int) -> tuple[int, int, int]:
    """A bright colour per token id; consecutive ids get far-apart hues (golden-ratio steps)."""
    hue = (token * _GOLDEN) % 1.0
    saturation = 0.85 if token % 2 else 0.6
    r, g, b = colorsys.hsv_to_rgb(hue, saturation, 1.0)
    return round(r * 255), round(g * 255), round(b * 255)


def _border_colour(colour: tuple[int, int, int]) -> tuple[int, int, int]:
    """The darker shade of a token colour used for its group's outline."""
    return tuple(round(c * 0.55) for c in colour)


def _frame_colour(index: int) -> tuple[int, int, int]:
    if index < len(_FRAME_PALETTE):
        return _FRAME_PALETTE[index]
    r, g, b = colorsys.hsv_to_rgb((index * _GOLDEN) % 1.0, 0.9, 0.8)
    return round(r * 255), round(g * 255), round(b * 255)


def _draw_frame(
    pixels: torch.Tensor, tokens: np.ndarray, highlight: np.ndarray, patch_pixels: int, alpha: float
) -> "PIL.Image.Image":
    """One input frame scaled to ``patch_pixels`` per patch, with merged patch groups tinted and outlined."""
    from PIL import Image

    h, w = tokens.shape
    array = (pixels.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    image = Image.fromarray(array).resize((w * patch_pixels, h * patch_pixels), Image.Resampling.BICUBIC)
    canvas = np.asarray(image).astype(np.float32)
    line = max(1, patch_pixels // 8)
    for i in range(h):
        for j in range(w):
            cell = canvas[i * patch_pixels : (i + 1) * patch_pixels, j * patch_pixels : (j + 1) * patch_pixels]
            token = int(tokens[i, j])
            if token < 0:  # pruned
                cell *= 0.25
                continue
            if not highlight[i, j]:
                continue
            colour = np.array(_token_colour(token), dtype=np.float32)
            cell[:] = (1 - alpha) * cell + alpha * colour
            border = np.array(_border_colour(_token_colour(token)), dtype=np.float32)
            if i == 0 or tokens[i - 1, j] != token:
                cell[:line] = border
            if i == h - 1 or tokens[i + 1, j] != token:
                cell[-line:] = border
            if j == 0 or tokens[i, j - 1] != token:
                cell[:, :line] = border
            if j == w - 1 or tokens[i, j + 1] != token:
                cell[:, -line:] = border
    return Image.fromarray(canvas.round().clip(0, 255).astype(np.uint8))


def draw_aggregation(
    groups: AggregationGroups, patch_pixels: int | None = None, columns: int | None = None, alpha: float = 0.45
) -> "PIL.Image.Image":
    """Draws :class:`AggregationGroups` as an RGB image (see :func:`visualize_aggregation`)."""
    from PIL import Image, ImageDraw, ImageFont

    frames = groups.pixels.shape[0]
    h, w = groups.patch_grid
    if patch_pixels is None:
        patch_pixels = max(16, groups.pixels.shape[-1] // w)
    if columns is None:
        columns = min(frames, 8)
    for name, value in (("patch_pixels", patch_pixels), ("columns", columns)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"`alpha` must lie in [0, 1], got {alpha!r}.")
    tokens = groups.source_map.view(frames, h, w).numpy()
    joint = groups.aggregation_dims == "joint"
    valid = tokens >= 0
    total = np.bincount(tokens[valid], minlength=groups.num_tokens)  # patches per token, over all frames

    # Which output frames hold more than one input frame, and a colour per such group in order of appearance.
    frame_groups = groups.frame_groups.tolist()
    members: dict[int, list[int]] = {}
    for t, g in enumerate(frame_groups):
        members.setdefault(g, []).append(t)
    group_colour = {}
    for g, ts in members.items():
        if g >= 0 and len(ts) > 1 and not joint:
            group_colour[g] = _frame_colour(len(group_colour))

    frame_w, frame_h = w * patch_pixels, h * patch_pixels
    ring = max(3, patch_pixels // 4)
    margin = ring + 3
    font = ImageFont.load_default()
    label_h, title_h = 14, 18
    rows = math.ceil(frames / columns)
    cell_w, cell_h = frame_w + 2 * margin, frame_h + 2 * margin + label_h
    canvas = Image.new("RGB", (max(columns * cell_w, 320), title_h + rows * cell_h), _BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    merged_frames = sum(len(members[g]) for g in group_colour)
    title = f"after block {groups.layer}: {groups.grid[0]} x {groups.grid[1]} tokens from {frames} x {h * w} patches; "
    if joint:
        title += "joint space-time merging (no frame groups)"
    else:
        title += f"{merged_frames} frames in {len(group_colour)} merged groups"
    draw.text((4, 3), title, fill=(0, 0, 0), font=font)

    boxes = []
    for t in range(frames):
        frame_tokens = tokens[t]
        flat = frame_tokens[frame_tokens >= 0]
        in_frame = np.bincount(flat, minlength=groups.num_tokens) if flat.size else np.zeros(groups.num_tokens, int)
        safe = np.where(frame_tokens >= 0, frame_tokens, 0)
        highlight = (frame_tokens >= 0) & (in_frame[safe] > 1)
        if joint:
            highlight |= (frame_tokens >= 0) & (total[safe] > 1)
        image = _draw_frame(groups.pixels[t], frame_tokens, highlight, patch_pixels, alpha)
        row, col = divmod(t, columns)
        x0, y0 = col * cell_w + margin, title_h + row * cell_h + margin
        canvas.paste(image, (x0, y0))
        x1, y1 = x0 + frame_w, y0 + frame_h  # exclusive
        boxes.append((x0, y0, x1, y1))
        g = frame_groups[t]
        if g in group_colour:
            draw.rectangle((x0 - ring, y0 - ring, x1 - 1 + ring, y1 - 1 + ring), outline=group_colour[g], width=ring)
            label = f"{t} -> frame {g}"
        elif g < 0:
            draw.rectangle((x0 - 2, y0 - 2, x1 + 1, y1 + 1), outline=_PRUNED_FRAME_OUTLINE, width=2)
            label = f"{t} pruned"
        else:
            draw.rectangle((x0 - 1, y0 - 1, x1, y1), outline=_SINGLE_FRAME_OUTLINE, width=1)
            label = f"{t}" if joint else f"{t} -> frame {g}"
        draw.text((x0, y1 + ring + 1), label, fill=(0, 0, 0), font=font)
    canvas.info["frame_boxes"] = boxes
    canvas.info["patch_pixels"] = patch_pixels
    canvas.info["frame_groups"] = frame_groups
    return canvas


def visualize_aggregation(
    model: Any,
    processor: Any,
    video: Any,
    layer: int = -1,
    *,
    patch_pixels: int | None = None,
    columns: int | None = None,
    alpha: float = 0.45,
    image_mean: Any = None,
    image_std: Any = None,
    processor_kwargs: dict | None = None,
) -> "PIL.Image.Image":
    """Draws which frames and patches of ``video`` the TESTA encoder has merged after block ``layer``.

    Frames merged together are outlined with the same coloured rectangle (thin grey: not merged; black: all patches
    pruned). Patches merged together share a translucent fill and an outline in a darker shade of the same colour
    (the paper's "same inner and border color"); unmerged patches keep their pixels, pruned ones are darkened. The
    colour is that of the output token, so across merged frames the same token has the same colour. With
    ``aggregation_dims="joint"`` frames are never merged as a whole; patches are then painted whenever their token
    holds any other patch, in any frame.

    Args:
        model: a ``TestaVisionModel`` or any model with a ``.vision_model`` one (e.g. ``TestaForVideoTextRetrieval``),
            also when loaded as Hub remote code. It is run in eval mode up to ``layer``; the model code is not changed.
        processor: ``None``, or an object callable as ``processor(videos=[video], return_tensors="pt")`` that returns
            ``pixel_values`` of shape ``(1, frames, 3, height, width)`` (e.g. ``TestaVideoProcessor``); its
            ``image_mean`` / ``image_std`` (or those of its ``video_processor``) undo the normalisation for drawing.
        video: whatever ``processor`` accepts (a path, an array of frames, ...); without a processor, a float
            ``pixel_values`` tensor ``(frames, 3, height, width)`` or ``(1, frames, 3, height, width)``.
        layer: the block after which the groups are shown; negative counts from the end (-1: the encoder output).
        patch_pixels: display size of one patch in pixels (default: the input patch size, at least 16).
        columns: frames per row (default: up to 8).
        alpha: opacity of the group fill.
        image_mean, image_std: the normalisation of ``pixel_values`` (default: the processor's; without either, the
            frames are stretched linearly to [0, 1] for drawing).
        processor_kwargs: extra keyword arguments for the processor call (e.g. ``{"num_frames": 16}``).

    Returns:
        An RGB ``PIL.Image``. ``image.info`` holds ``"frame_boxes"`` (the ``(x0, y0, x1, y1)`` pixel box of every
        input frame, end exclusive; the group rectangle lies just outside it), ``"patch_pixels"`` and
        ``"frame_groups"`` (the output frame of every input frame, -1 = pruned).
    """
    groups = aggregation_groups(model, processor, video, layer, image_mean, image_std, processor_kwargs)
    return draw_aggregation(groups, patch_pixels=patch_pixels, columns=columns, alpha=alpha)


__all__ = [
    "AggregationGroups",
    "aggregation_groups",
    "displayable_frames",
    "draw_aggregation",
    "frame_groups_of",
    "trace_sources",
    "video_pixel_values",
    "vision_encoder",
    "visualize_aggregation",
]
