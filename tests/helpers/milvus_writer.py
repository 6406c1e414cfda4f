"""One writer process of the Milvus server test: upserts rows ``[start, stop)`` of a seeded collection of unit
vectors into a `MilvusHome` (its settings checked, then one shard writer and the library's encode loop), one row per
batch, pausing `delay` s per batch (so that a test can kill it halfway). A `LookupModel` stands in for the encoder: its "pixels" are row numbers and its embedding
of row i is row i of the collection (so the rows a build must hold are known exactly)."""

import sys
import time
from types import SimpleNamespace

import torch

from testa_search.homes import IndexEntry
from testa_search.encoding import encode_videos
from testa_search.milvus import MilvusHome

SETTINGS = {"model_class": "LookupModel", "num_frames": 1}
"""What the writers of one collection record and share (with the embedding size)."""


def collection(count: int, dim: int, seed: int = 0) -> tuple[list[IndexEntry], torch.Tensor]:
    """The rows (videos in two folders and datasets; every 5th video also split into two moments) and their unit
    embeddings."""
    entries = []
    for i in range(count):
        folder = "cats" if i % 2 else "dogs"
        entries.append(IndexEntry(f"/data/{folder}/clip{i:04d}.mp4", dataset=f"set{i % 3}"))
    for i in range(0, count, 5):
        entries.append(IndexEntry(f"/data/long/clip{i:04d}.mp4", start=0.0, end=5.0, dataset="long"))
        entries.append(IndexEntry(f"/data/long/clip{i:04d}.mp4", start=5.0, end=10.0, dataset="long"))
    vectors = torch.nn.functional.normalize(torch.randn(len(entries), dim, generator=torch.Generator().manual_seed(seed)),
                                            dim=1)
    return entries, vectors


class LookupModel(torch.nn.Module):
    """A stand-in encoder: pixel values are row numbers; the embedding of row i is ``table[i]``."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def get_video_tokens(self, pixel_values):
        rows = pixel_values.long().flatten()
        return SimpleNamespace(last_hidden_state=self.table[rows].unsqueeze(1), token_sizes=None)

    def get_video_features(self, video_tokens, video_token_sizes=None):
        return SimpleNamespace(pooler_output=video_tokens[:, 0])


def main(uri: str, count: int, dim: int, start: int, stop: int, delay: float) -> None:
    entries, vectors = collection(count, dim)

    def decode(rows, positions):
        for position in positions:
            time.sleep(delay)
            yield [position], torch.tensor([float(position)]), []

    home = MilvusHome(uri)
    home.check_settings({**SETTINGS, "projection_dim": dim})
    with home.writer(0, start, stop, resume=True, entries=entries) as writer:
        todo = [i for i in range(start, stop) if i not in writer.done]
        encode_videos(LookupModel(vectors), decode(entries, todo), writer, summary=False)
    print("done", flush=True)


if __name__ == "__main__":
    uri, count, dim, start, stop, delay = sys.argv[1:]
    main(uri, int(count), int(dim), int(start), int(stop), float(delay))
