"""Draws TESTA's frame and patch aggregation of a synthetic video: docs/aggregation_example.png.

    HF_HUB_OFFLINE=1 python -m benchmarks.make_visualization [--out docs/aggregation_example.png] [--layer -1]

The video (16 frames, 224 px) is drawn here with numpy, three shots of coloured shapes (see `synthetic_video`): a
landscape with a rolling ball, a room with a sliding box, the landscape at sunset. The encoder is a randomly
initialised ViT-B/16-shaped TESTA encoder of reduced width (12 blocks, 192 channels, position embeddings as
initialised) with R_S=12 in every block and R_T=1 in the first 8 blocks (16 -> 8 frames, 196 -> 52 patches), so the
picture shows what the aggregation does with raw pixel similarity, not what a trained model learned. Runs in a few
seconds on CPU; the result is deterministic (fixed seeds).
"""

import argparse
from pathlib import Path

import numpy as np
import torch

from modeling_testa import TestaVisionConfig, TestaVisionModel
from modeling_testa.visualization import visualize_aggregation


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def synthetic_video(num_frames: int = 16, size: int = 224, seed: int = 0) -> np.ndarray:
    """``(frames, size, size, 3)`` uint8: three shots of moving and static coloured shapes.

    Shot 1 (first 3/8 of the frames): a sky gradient over flat grass, a blue house, a red ball rolling to the right.
    Shot 2 (next 5/16): a room (purple wall, brown floor) with a green box sliding left. Shot 3 (the rest): the
    landscape at sunset (orange sky) with a yellow sun and the ball at rest. Every frame gets mild sensor noise.
    """
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    horizon = int(size * 0.62)
    cut1, cut2 = round(num_frames * 3 / 8), round(num_frames * 11 / 16)
    video = []
    for t in range(num_frames):
        frame = np.zeros((size, size, 3), np.float32)
        if t < cut1 or t >= cut2:  # landscape
            sunset = t >= cut2
            top, bottom = ((230, 120, 60), (250, 200, 120)) if sunset else ((90, 150, 235), (190, 220, 250))
            sky = (yy / horizon)[..., None]
            frame[:] = (1 - sky) * np.array(top) + sky * np.array(bottom)
            frame[horizon:] = (70, 150, 60)  # grass
            frame[int(size * 0.35) : int(size * 0.7), int(size * 0.08) : int(size * 0.34)] = (40, 60, 170)  # house
            progress = 1.0 if sunset else t / max(cut1 - 1, 1)
            cx, cy, r = size * (0.45 + 0.35 * progress), size * 0.8, size * 0.09
            frame[(xx - cx) ** 2 + (yy - cy) ** 2 <= r**2] = (220, 40, 40)  # ball
            if sunset:
                frame[(xx - size * 0.8) ** 2 + (yy - size * 0.18) ** 2 <= (size * 0.09) ** 2] = (250, 230, 60)  # sun
        else:  # the room
            frame[:] = (120, 70, 140)  # wall
            frame[int(size * 0.7) :] = (120, 80, 40)  # floor
            frame[int(size * 0.12) : int(size * 0.35), int(size * 0.6) : int(size * 0.88)] = (230, 230, 220)  # window
            progress = (t - cut1) / max(cut2 - cut1 - 1, 1)
            left = int(size * (0.55 - 0.4 * progress))
            frame[int(size * 0.5) : int(size * 0.78), left : left + int(size * 0.25)] = (40, 170, 80)  # box
        frame += rng.normal(0, 3, frame.shape)
        video.append(frame.clip(0, 255).astype(np.uint8))
    return np.stack(video)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "aggregation_example.png"))
    parser.add_argument("--layer", type=int, default=-1)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = TestaVisionConfig(
        num_frames=16, image_size=224, patch_size=16, hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
        intermediate_size=768, temporal_reduction=[1] * 8 + [0] * 4, spatial_reduction=12,
    )
    model = TestaVisionModel(config).eval()
    video = torch.from_numpy(synthetic_video()).permute(0, 3, 1, 2).float() / 255.0
    pixel_values = (video - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    image = visualize_aggregation(
        model, None, pixel_values, layer=args.layer, columns=8, image_mean=CLIP_MEAN, image_std=CLIP_STD
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)
    print(f"wrote {out} ({image.width}x{image.height}); frame groups: {image.info['frame_groups']}")


if __name__ == "__main__":
    main()
