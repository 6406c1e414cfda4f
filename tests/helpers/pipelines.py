"""Tiny TESTA retrieval / QA models with the real TestaProcessor, saved as Hub folders, and a set of real mp4 files,
shared by the pipeline and remote-code tests."""

import sys
from pathlib import Path

import torch
from .models import tiny_vision_config
from .models import randomize
from .videos import write_noise_video, write_video, zero_media_data

from modeling_testa import TestaConfig, TestaForVideoQA, TestaForVideoTextRetrieval, TestaProcessor, TestaVideoProcessor


FRAMES, SIZE = 4, 32

TEXT = dict(
    vocab_size=30524,  # the shipped BERT vocabulary + [DEC] + [ENC]
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    bos_token_id=30522,
    sep_token_id=102,
    pad_token_id=0,
)

# (name, frames, fps, width, height, gray): different lengths, frame rates and sizes, one grayscale
VIDEO_SPECS = [
    ("short_10fps.mp4", 9, 10, 160, 128, False),
    ("medium_25fps.mp4", 30, 25, 192, 160, False),
    ("long_30fps.mp4", 61, 30, 176, 144, False),
    ("gray_15fps.mp4", 20, 15, 160, 160, True),
    ("wide_24fps.mp4", 14, 24, 224, 128, False),
]


def tiny_testa_config(**overrides) -> TestaConfig:
    """2-layer video encoder on 4 frames of 32x32 and a 2-layer BERT on the real 30524-token vocabulary."""
    settings = dict(projection_dim=16, queue_size=8, label_smoothing=0.1, k_test=3)
    settings.update(overrides)
    vision = tiny_vision_config(num_frames=FRAMES, temporal_reduction=1, spatial_reduction=3).to_dict()
    return TestaConfig(vision_config=vision, text_config=dict(TEXT), **settings)


def tiny_processor() -> TestaProcessor:
    video_processor = TestaVideoProcessor(
        num_frames=FRAMES, size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}
    )
    return TestaProcessor(video_processor=video_processor)


def build_retrieval(seed: int = 0) -> TestaForVideoTextRetrieval:
    torch.manual_seed(seed)
    model = TestaForVideoTextRetrieval(tiny_testa_config())
    randomize(model, seed=seed)
    with torch.no_grad():
        model.temp.fill_(0.2)
    return model.eval()


def build_qa(seed: int = 1) -> TestaForVideoQA:
    torch.manual_seed(seed)
    model = TestaForVideoQA(tiny_testa_config())
    randomize(model, seed=seed)
    return model.eval()


def save_folder(model, processor: TestaProcessor, folder: Path) -> Path:
    """What a user does to publish a model: the model and its processor, saved into one folder."""
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_videos(directory: Path) -> list[str]:
    """The real mp4 files of `VIDEO_SPECS`."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        str(write_video(directory / name, frames, fps=fps, width=width, height=height, gray=gray))
        for name, frames, fps, width, height, gray in VIDEO_SPECS
    ]


def write_bad_files(directory: Path, good_video: str) -> dict[str, str]:
    """Broken inputs: an empty file, a truncated mp4, a text file named .mp4, and an mp4 with no decodable frame."""
    directory.mkdir(parents=True, exist_ok=True)
    empty = directory / "empty.mp4"
    empty.write_bytes(b"")
    data = Path(good_video).read_bytes()
    truncated = directory / "truncated.mp4"
    truncated.write_bytes(data[: len(data) // 3])
    text = directory / "notes.mp4"
    text.write_text("this is not a video, just some text\n" * 20)
    no_frames = zero_media_data(Path(good_video), directory / "no_frames.mp4")
    return {"empty": str(empty), "truncated": str(truncated), "text": str(text), "no_frames": str(no_frames)}


@torch.no_grad()
def reference_ranking(model, processor: TestaProcessor, queries: list[str], videos: list[str]) -> torch.Tensor:
    """Scores `(num_queries, num_videos)` computed without the pipeline: every video through the processor and the
    encoder on its own, then `model.rank_videos` re-ranking every video (k = all)."""
    tokens, sizes = [], []
    for video in videos:
        pixel_values = processor(videos=video)["pixel_values"]
        out = model.get_video_tokens(pixel_values)
        tokens.append(out.last_hidden_state)
        sizes.append(out.token_sizes)
    text = processor(text=queries)
    ranking = model.rank_videos(
        text["input_ids"], torch.cat(tokens), attention_mask=text["attention_mask"],
        video_token_sizes=torch.cat(sizes), k=len(videos),
    )
    return ranking.scores


INDEX_COMMAND = [sys.executable, "-m", "train.index"]
"""`train.index` in one process."""
INDEX_LAUNCH_2 = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "train.index"]
"""`train.index` on two CPU processes of one `accelerate launch`."""


def index_collection(root: Path, num_videos: int) -> tuple[Path, Path]:
    """A saved tiny retrieval model (``root/model``) and ``num_videos`` noise clips (``root/videos/clipNNN.mp4``):
    what the `train.index` tests index. Returns ``(root, model folder)``."""
    model = save_folder(build_retrieval(), tiny_processor(), root / "model")
    for i in range(num_videos):
        write_noise_video(root / "videos" / f"clip{i:03d}.mp4", seed=i)
    return root, model
