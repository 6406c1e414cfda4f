"""What the encoder benchmarks (`encoder_speed.py`, `fast_inference.py`, `memory_96.py`) share: the command-line
options of the encoder they build, the config fields those options set, and the resident-set reading of their
fresh-process memory measurements."""

import argparse
from pathlib import Path


def add_encoder_arguments(parser: argparse.ArgumentParser, frames: int, temporal_reduction: int,
                          spatial_reduction: int) -> None:
    """``--frames --image-size --hidden-size --layers --heads --temporal-reduction --spatial-reduction`` (ViT-B/16 at
    224 px by default; the frame count and the per-block reductions are the benchmark's own)."""
    parser.add_argument("--frames", type=int, default=frames)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--temporal-reduction", type=int, default=temporal_reduction)
    parser.add_argument("--spatial-reduction", type=int, default=spatial_reduction)


def encoder_settings(args: argparse.Namespace) -> dict:
    """The architecture fields those options set, as `TestaVisionConfig` and transformers' `TimesformerConfig` name
    them (the MLP is 4x the width, as in ViT-B)."""
    return dict(num_frames=args.frames, image_size=args.image_size, hidden_size=args.hidden_size,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, intermediate_size=4 * args.hidden_size)


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB, e.g. ``"VmRSS:"`` (resident set) or ``"VmHWM:"`` (its high-water mark,
    reset by writing ``5`` to ``/proc/self/clear_refs``). Linux only."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])
