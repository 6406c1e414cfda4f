"""Command line: draw TESTA's frame and patch aggregation of one video as a PNG.

    python -m modeling_testa.visualize VIDEO --model FOLDER --out PNG [--layer -1] [--num-frames N]

``FOLDER`` is a model saved with ``save_pretrained`` (a ``TestaVisionModel`` or a model with a ``.vision_model``, e.g.
``TestaForVideoTextRetrieval``). With an ``auto_map`` in its ``config.json`` it is loaded with
``AutoModel.from_pretrained(FOLDER, trust_remote_code=True)``, otherwise with this package's class named in
``architectures``. Frames come from the folder's video processor when it has one (``AutoVideoProcessor`` /
``AutoProcessor``), else from a ``TestaVideoProcessor`` built for the model (its image size and frame count, uniform
sampling, square resize, CLIP normalisation).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .video_processing_testa import TestaVideoProcessor
from .visualization import visualize_aggregation


_PROCESSOR_FILES = ("video_preprocessor_config.json", "preprocessor_config.json", "processor_config.json")


def load_model(folder: str | Path) -> Any:
    """Loads a saved TESTA model from ``folder`` (remote code through ``AutoModel`` when the config has an
    ``auto_map``, this package's classes otherwise)."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"--model {str(folder)!r} has no config.json; give a folder written by save_pretrained."
        )
    config = json.loads(config_file.read_text())
    if "AutoModel" in config.get("auto_map", {}):
        from transformers import AutoModel  # noqa: PLC0415

        return AutoModel.from_pretrained(folder, trust_remote_code=True)
    from . import modeling_testa  # noqa: PLC0415

    names = list(config.get("architectures") or [])
    if config.get("model_type") == "testa_vision_model":
        names.append("TestaVisionModel")
    for name in names:
        model_class = getattr(modeling_testa, name, None)
        if isinstance(model_class, type) and hasattr(model_class, "from_pretrained"):
            return model_class.from_pretrained(folder)
    raise ValueError(
        f"Cannot tell which TESTA class to load from {str(config_file)!r}: "
        f"architectures={config.get('architectures')}, model_type={config.get('model_type')!r} and no auto_map."
    )


def load_processor(folder: str | Path, num_frames: int, image_size: int) -> tuple[Any, str]:
    """The video processor to use and a description of where it came from: the one saved in ``folder``, else a
    ``TestaVideoProcessor`` sampling ``num_frames`` frames resized to ``image_size`` squared."""
    folder = Path(folder)
    if any((folder / name).is_file() for name in _PROCESSOR_FILES):
        from transformers import AutoProcessor, AutoVideoProcessor  # noqa: PLC0415

        errors = []
        for loader in (AutoVideoProcessor, AutoProcessor):
            try:
                return loader.from_pretrained(folder, trust_remote_code=True), f"{loader.__name__} from {folder}"
            except (OSError, ValueError, KeyError, TypeError, ImportError) as error:
                errors.append(f"{loader.__name__}: {error}")
        print(f"warning: the processor in {folder} could not be loaded ({'; '.join(errors)})", file=sys.stderr)
    return TestaVideoProcessor.for_model_input(num_frames, image_size), f"TestaVideoProcessor at {image_size} px"


def main(argv: list[str] | None = None) -> int:
    """Runs the command line (``argv``: the arguments, default ``sys.argv[1:]``); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m modeling_testa.visualize", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("video", help="the video file")
    parser.add_argument("--model", required=True, help="folder of a saved TESTA model")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--layer", type=int, default=-1, help="show the groups after this block (-1: the last)")
    parser.add_argument("--num-frames", type=int, default=None, help="frames to sample (default: the model's)")
    parser.add_argument("--patch-pixels", type=int, default=None, help="display size of one patch in pixels")
    parser.add_argument("--columns", type=int, default=None, help="frames per row (default: up to 8)")
    args = parser.parse_args(argv)
    if not Path(args.video).is_file():
        parser.error(f"VIDEO {args.video!r} is not a file.")
    if args.num_frames is not None and args.num_frames < 1:
        parser.error(f"--num-frames must be a positive int, got {args.num_frames}.")

    model = load_model(args.model).eval()
    config = getattr(model, "vision_model", model).config
    num_frames = args.num_frames or config.num_frames
    processor, origin = load_processor(args.model, num_frames, config.image_size)
    processor_kwargs = {"num_frames": args.num_frames} if args.num_frames else None
    image = visualize_aggregation(
        model, processor, args.video, layer=args.layer, patch_pixels=args.patch_pixels, columns=args.columns,
        processor_kwargs=processor_kwargs,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, format="PNG")
    print(f"wrote {out} ({image.width}x{image.height}; frames from {origin})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
