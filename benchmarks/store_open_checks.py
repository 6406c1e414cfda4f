"""What checking a video store costs when it is opened (`DamagedStoreError`: file sizes, row maps, journals, the
row-order embeddings against the kept ones; see `testa_search/store/video_store.py`).

    python -m benchmarks.store_open_checks                       # 100k videos
    python -m benchmarks.store_open_checks --sizes 100000 1000000

Per size, two layouts of synthetic stores (random unit 256-d embeddings, tiny fp16 tokens 21 x 32 per video, as
`benchmarks/search_scale.py`): the one `train.index` writes (shards of 256 videos, batches of 8, so one journal
line per 8 videos) and one shard written in batches of 20,000. It times `VideoTokenStore(directory)` (the whole open,
checks included) and the checks alone (the same check functions over the same shards), best of `--repeats` with a
warm page cache, and prints the share of the open spent checking.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from testa_search.store.video_store import (
    SHARD_FIELDS,
    VideoStoreWriter,
    VideoTokenStore,
    check_data_file,
    check_journal,
    check_row_embeddings,
    check_row_map,
    finalize_store,
    open_safetensors,
    store_metadata,
)

DIM, NUM_TOKENS, TOKEN_WIDTH = 256, 21, 32


def write_store(directory: Path, count: int, shard_size: int, batch_size: int) -> None:
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.nn.functional.normalize(torch.randn(count, DIM, generator=generator), dim=-1)
    shards = [(start, min(start + shard_size, count)) for start in range(0, count, shard_size)]
    for shard, (start, stop) in enumerate(shards):
        with VideoStoreWriter(directory, shard, start, stop, token_dtype=torch.float16) as writer:
            for first in range(start, stop, batch_size):
                rows = list(range(first, min(first + batch_size, stop)))
                tokens = torch.randn(len(rows), NUM_TOKENS, TOKEN_WIDTH, generator=generator).half()
                writer.add_batch(rows, tokens, None, embeddings[rows])
    finalize_store(directory, [f"video{i:07d}.mp4" for i in range(count)], len(shards))


def shard_file(kind: str, number: int, extension: str) -> str:
    """A shard's file name, as `video_store.py` lays a store out (``tokens-00000.bin``)."""
    return f"{kind}-{number:05d}.{extension}"


def checks_only(directory: Path) -> None:
    """The checks `open_shard` runs, over every shard, without building the store object."""
    meta = store_metadata(directory)
    token_bytes = meta["num_tokens"] * meta["hidden_size"] * 2
    for shard in meta["shards"]:
        number, start, stop, num_rows = (int(shard[key]) for key in SHARD_FIELDS)
        path = directory / shard_file("shard", number, "safetensors")
        tensors = open_safetensors(path)
        check_row_map(path, tensors["rows"], num_rows)
        for kind, size in (("tokens", token_bytes), ("embeddings", DIM * 4), ("token_sizes", 0)):
            check_data_file(directory / shard_file(kind, number, "bin"), num_rows, size)
        check_journal(directory / shard_file("journal", number, "jsonl"), tensors["rows"], number, start, stop)
        check_row_embeddings(directory / shard_file("embeddings", number, "bin"), path, tensors["rows"],
                             tensors["embeddings"], start)


def best_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        function()
        times.append(time.perf_counter() - begin)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| videos | layout | shards | open s (checks included) | checks s | checks share |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        for label, shard_size, batch_size in (("train.index (256 / 8)", 256, 8), ("one shard", size, 20_000)):
            with tempfile.TemporaryDirectory() as folder:
                directory = Path(folder)
                write_store(directory, size, shard_size, batch_size)
                opened = best_seconds(lambda: VideoTokenStore(directory).close(), args.repeats)
                checks = best_seconds(lambda: checks_only(directory), args.repeats)
                shards = len(store_metadata(directory)["shards"])
                print(f"| {size:,} | {label} | {shards} | {opened:.3f} | {checks:.3f} | {checks / opened:.0%} |",
                      flush=True)


if __name__ == "__main__":
    main()
