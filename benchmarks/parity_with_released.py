"""Runs the released TESTA video encoder and a converted copy of it side by side, and prints how far apart they are.

    git clone https://github.com/RenShuhuai-Andy/TESTA /path/to/TESTA   # the released code (@41b9486)
    pip install einops                                                  # the released code imports it
    python -m benchmarks.parity_with_released --released-repo /path/to/TESTA [--videos 32]

Nothing of the released code is copied here: the script imports its ``models/timesformer/models/vit.py`` and
``testa/`` from the folder you give, replacing only imports the encoder does not use (fairscale's checkpoint wrapper,
TimeSformer's pretrained-weights loader and model registry). It builds a tiny released encoder in float64 with random
weights (``temporal_fc`` non-zero, so temporal attention matters), patches it with the released ``apply_patch``
(``merging_type="frame&patch"``, ``prop_attn=False``, as every released script does), converts its weights with
``convert_original_testa`` and compares the output tokens on random slowly-changing videos, for every
``frame_matching`` rule and for several schedules. Token order differs on purpose (released: ``[CLS, (position,
frame)]``; ours: ``[CLS, (frame, position)]``), so ours is put in the released order first.

The released code runs ``torch.mode`` on float similarities; this script runs it on CPU, where that is reproducible.
"""

import argparse
import importlib
import logging
import math
import sys
import types
from pathlib import Path

import torch


REPO = Path(__file__).resolve().parents[1]

from modeling_testa.convert_original_testa import convert_original_testa
from modeling_testa.modeling_testa import token_schedule


def _package(name: str, path: Path | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)] if path is not None else []
    sys.modules[name] = module
    return module


def import_released(repo: Path):
    """Imports the released ``VisionTransformer`` and ``apply_patch`` without their unused heavy dependencies."""
    if not (repo / "testa" / "merge.py").is_file():
        raise FileNotFoundError(f"{repo} is not a checkout of RenShuhuai-Andy/TESTA (no testa/merge.py).")
    # Packages whose __init__ imports training-only code: registered empty, their files are found through __path__.
    _package("models", repo / "models")
    _package("models.timesformer", repo / "models" / "timesformer")
    _package("models.timesformer.models", repo / "models" / "timesformer" / "models")
    _package("testa", repo / "testa")
    _package("testa.patch", repo / "testa" / "patch")
    helpers = types.ModuleType("models.timesformer.models.helpers")
    helpers.load_pretrained = lambda *args, **kwargs: None  # pretrained-weights download: not used
    sys.modules[helpers.__name__] = helpers
    build = types.ModuleType("models.timesformer.models.build")

    class _Registry:
        def register(self):
            return lambda cls: cls

    build.MODEL_REGISTRY = _Registry()
    sys.modules[build.__name__] = build
    for name in ("fairscale", "fairscale.nn", "fairscale.nn.checkpoint"):
        _package(name)
    checkpointing = types.ModuleType("fairscale.nn.checkpoint.checkpoint_activations")
    checkpointing.checkpoint_wrapper = lambda module, *args, **kwargs: module  # gradient checkpointing: not used
    sys.modules[checkpointing.__name__] = checkpointing
    vit = importlib.import_module("models.timesformer.models.vit")
    patch = importlib.import_module("testa.patch.timesformer")
    return vit.VisionTransformer, patch.apply_patch


def released_model(vision_transformer, apply_patch, args, schedule: list[int], seed: int):
    torch.manual_seed(seed)
    model = vision_transformer(
        img_size=args.image_size, patch_size=args.patch_size, num_classes=0, embed_dim=args.width, depth=args.depth,
        num_heads=args.heads, mlp_ratio=4, qkv_bias=True, norm_layer=lambda d: torch.nn.LayerNorm(d, eps=1e-6),
        num_frames=args.frames, attention_type="divided_space_time",
    )
    with torch.no_grad():  # random weights everywhere, temporal_fc included (the released init zeroes it)
        for name, param in model.named_parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            scale = 1.0 if "embed" in name or "token" in name else (1 / math.sqrt(fan_in) if param.dim() > 1 else 0.1)
            param.copy_(torch.randn_like(param) * scale + (1.0 if name.endswith("norm1.weight") or
                                                            name.endswith("norm2.weight") else 0.0))
    model = model.double().eval()
    apply_patch(model, trace_source=False, prop_attn=False, merging_type="frame&patch")
    model.r = list(schedule)
    model.merging_type = "frame&patch"
    return model


def text_state(width: int) -> dict[str, torch.Tensor]:
    """A minimal one-layer med.py text encoder: the converter needs one, the comparison does not use it."""
    state = {
        "text_encoder.embeddings.word_embeddings.weight": torch.randn(30524, width),
        "text_encoder.embeddings.position_embeddings.weight": torch.randn(64, width),
        "text_encoder.embeddings.LayerNorm.weight": torch.ones(width),
        "text_encoder.embeddings.LayerNorm.bias": torch.zeros(width),
    }
    layer = "text_encoder.encoder.layer.0"
    for attention in ("attention", "crossattention"):
        for proj in ("query", "key", "value"):
            state[f"{layer}.{attention}.self.{proj}.weight"] = torch.randn(width, width)
            state[f"{layer}.{attention}.self.{proj}.bias"] = torch.zeros(width)
        state[f"{layer}.{attention}.output.dense.weight"] = torch.randn(width, width)
        state[f"{layer}.{attention}.output.dense.bias"] = torch.zeros(width)
        state[f"{layer}.{attention}.output.LayerNorm.weight"] = torch.ones(width)
        state[f"{layer}.{attention}.output.LayerNorm.bias"] = torch.zeros(width)
    state[f"{layer}.intermediate.dense.weight"] = torch.randn(4 * width, width)
    state[f"{layer}.intermediate.dense.bias"] = torch.zeros(4 * width)
    state[f"{layer}.output.dense.weight"] = torch.randn(width, 4 * width)
    state[f"{layer}.output.dense.bias"] = torch.zeros(width)
    state[f"{layer}.output.LayerNorm.weight"] = torch.ones(width)
    state[f"{layer}.output.LayerNorm.bias"] = torch.zeros(width)
    for name in ("vision_proj", "text_proj"):
        state[f"{name}.weight"], state[f"{name}.bias"] = torch.randn(16, width), torch.zeros(16)
    state["itm_head.weight"], state["itm_head.bias"] = torch.randn(2, width), torch.zeros(2)
    state["temp"] = torch.tensor(0.07)
    return state


def videos(args, seed: int) -> torch.Tensor:
    """Slowly changing random videos ``(N, T, 3, H, W)``: neighbouring frames are similar, as in real video."""
    g = torch.Generator().manual_seed(seed)
    size = (args.videos, 1, 3, args.image_size, args.image_size)
    base = torch.randn(*size, generator=g)
    drift = torch.randn(args.videos, args.frames, 3, args.image_size, args.image_size, generator=g).cumsum(1) * 0.3
    return (base + drift).double()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--released-repo", type=Path, required=True, help="a checkout of RenShuhuai-Andy/TESTA")
    parser.add_argument("--videos", type=int, default=32)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--patch-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    vision_transformer, apply_patch = import_released(args.released_repo.resolve())
    logging.getLogger("modeling_testa").setLevel(logging.ERROR)  # the text side's momentum copies are not needed
    torch.set_num_threads(2)

    schedules = {  # interleaved [R_T, R_S] per block, as in the released configs' testa_r
        "no merging": [0, 0] * args.depth,
        "patches only": [0, 3] * args.depth,
        "frames only": [2, 0] * args.depth,
        "frames and patches (f1p3)": [1, 3] * args.depth,
        "frames and patches (f2p2)": [2, 2] * args.depth,
    }
    print(f"released code: {args.released_repo}; {args.videos} videos x {args.frames} frames of {args.image_size} px, "
          f"patch {args.patch_size}, width {args.width}, depth {args.depth}, float64 on CPU\n")
    print(f"| schedule | frame_matching | videos equal to {args.tolerance:g} | max abs diff |")
    print("|---|---|---|---|")
    failures = 0
    for index, (label, schedule) in enumerate(schedules.items()):
        released = released_model(vision_transformer, apply_patch, args, schedule, seed=index)
        state = {f"visual_encoder.{k}": v.float() for k, v in released.state_dict().items()}
        state.update(text_state(args.width))
        config = dict(num_frames=args.frames, image_size=args.image_size, testa_r=schedule,
                      merging_type="frame&patch", token_merging=True, num_heads=args.heads)
        # The released weights went through float32 so both sides use identical values.
        released.load_state_dict({k[len("visual_encoder."):]: v.double() for k, v in state.items()
                                  if k.startswith("visual_encoder.")})
        clips = videos(args, seed=100 + index)
        with torch.no_grad():
            reference = released(clips.transpose(1, 2))  # the released input layout is (B, 3, T, H, W)
        for rule in ("original", "vote", "mean"):
            model, _ = convert_original_testa({"model": state, "config": config}, frame_matching=rule,
                                              text_config=dict(num_attention_heads=1))
            vision = model.vision_model.double()
            with torch.no_grad():
                out = vision(clips)
            ours, equal, worst = out.last_hidden_state, 0, 0.0
            for b in range(args.videos):
                if ours[b].shape != reference[b].shape:
                    worst = math.inf
                    continue
                frames_out = token_schedule(vision.config)[-1][0]
                patches = ours[b, 1:].view(frames_out, -1, ours.shape[-1]).transpose(0, 1).reshape(-1, ours.shape[-1])
                diff = float((torch.cat([ours[b, :1], patches]) - reference[b]).abs().max())
                worst = max(worst, diff)
                equal += diff <= args.tolerance
            print(f"| {label} | {rule} | {equal}/{args.videos} | {worst:.2e} |")
            failures += rule == "original" and equal != args.videos
    print("\nframe_matching='original' (the converter's default) matches the released code on every video."
          if not failures else f"\n{failures} schedules differ with frame_matching='original'.")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
