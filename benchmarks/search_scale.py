"""Searching large collections: per-query latency, first-stage build time, memory and recall at 10k to 1M videos.

    python -m benchmarks.search_scale                              # 10k, 100k and 1M videos, 2 threads
    python -m benchmarks.search_scale --sizes 200000 --recall-200k # first-stage recall@10 on a 200k set only
    python -m benchmarks.search_scale --sizes 100000 --kinds pq hnsw ivf --no-rerank   # compare approximate kinds

The collection: N synthetic L2-normalised 256-d embeddings (random unit vectors: no clusters, so the worst case for
an approximate index's recall), written as a real on-disk video store (`VideoStoreWriter`, one shard) with tiny
synthetic tokens (21 x 32 fp16 per video, what the tiny model below cross-attends to), then opened with
`VideoIndex.load` (memory-mapped embeddings, tokens left on disk).

Per size and first-stage kind, it reports:

- build: seconds to build the first stage (`VideoIndex.build_first_stage`; the default kind is exact `IndexFlatIP` up
  to `EXACT_MAX_VIDEOS`, a fast-scan PQ with exact re-scoring above), the bytes of its saved file, and the seconds
  `VideoIndex.load` takes to reopen the store and the saved stage, with the process's RSS growth over that open
  (which counts the memory-mapped embeddings file, 1 KB per video, page cache rather than a copy) and its
  anonymous memory growth (what was allocated or copied: the names, the row maps, the first stage);
- first stage: p50 / p95 milliseconds of `index.nearest(query, k=10)` for one query at a time (random unit
  queries), and recall@10 of those results against exact float32 search (torch matrix product over the whole
  collection);
- search: p50 / p95 ms of one query through `VideoTextRetrievalPipeline.search(text, index, top_k=10,
  rerank=False)` with a tiny random TESTA model whose projection is 256-d (text encoding by a 2-layer BERT of width
  32, the first stage, the result list), and the same with `rerank=True, rerank_k=16`: the 16 candidates' tokens are
  read from the store on disk (positioned reads) and scored by the tiny matching head (2-layer cross-attention).
  The tiny model keeps the model's cost small, so these columns show the search machinery, not a real model's ITM
  cost (see benchmarks/rerank_cost.py for that).

Threads: `--threads` (default 2) for torch and FAISS. Numbers depend on the machine and on its load.
"""

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from modeling_testa import TestaConfig, TestaForVideoTextRetrieval, TestaProcessor, TestaVideoProcessor
from modeling_testa.pipeline_testa import VideoTextRetrievalPipeline
from testa_search.index import EXACT_MAX_VIDEOS, FIRST_STAGE_FILE, VideoIndex, faiss_module
from testa_search.store.video_store import VideoStoreWriter, finalize_store


DIM = 256
NUM_TOKENS, TOKEN_WIDTH = 21, 32  # the tiny model's aggregated tokens per video (4 frames of 32 px, R_S=3)
QUERY_TEXTS = ["a red square moves to the right", "a blue bar goes down", "a dark gradient", "a cat on a sofa",
               "people dancing at night", "a car on a wet road", "someone cooking pasta", "waves on a beach"]


def tiny_pipeline(projection_dim: int = DIM) -> VideoTextRetrievalPipeline:
    """A random tiny retrieval model (2-layer video encoder on 4 frames of 32 px, 2-layer BERT of width 32) whose
    contrastive projection is `projection_dim`-d, with the real processor."""
    vision = dict(num_frames=4, image_size=32, patch_size=8, hidden_size=TOKEN_WIDTH, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64, temporal_reduction=1, spatial_reduction=3)
    text = dict(vocab_size=30524, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, bos_token_id=30522, sep_token_id=102, pad_token_id=0)
    torch.manual_seed(0)
    model = TestaForVideoTextRetrieval(TestaConfig(vision_config=vision, text_config=text,
                                                   projection_dim=projection_dim, k_test=16)).eval()
    video_processor = TestaVideoProcessor(num_frames=4, size={"shortest_edge": 32},
                                          crop_size={"height": 32, "width": 32})
    return VideoTextRetrievalPipeline(model=model, processor=TestaProcessor(video_processor=video_processor),
                                      device="cpu")


def unit_vectors(count: int, dim: int, seed: int, chunk: int = 100_000) -> torch.Tensor:
    """`count` random unit vectors, generated in chunks (fp32)."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.empty(count, dim)
    for start in range(0, count, chunk):
        out[start : start + chunk] = F.normalize(torch.randn(min(chunk, count - start), dim, generator=generator),
                                                 dim=-1)
    return out


def write_synthetic_store(directory: Path, embeddings: torch.Tensor, info: dict, chunk: int = 20_000) -> None:
    """A one-shard store of `embeddings` with random fp16 tokens (the tiny model's shape) and token sizes."""
    count = embeddings.shape[0]
    generator = torch.Generator().manual_seed(1)
    with VideoStoreWriter(directory, 0, 0, count, token_dtype=torch.float16) as writer:
        for start in range(0, count, chunk):
            rows = list(range(start, min(start + chunk, count)))
            tokens = torch.randn(len(rows), NUM_TOKENS, TOKEN_WIDTH, generator=generator).half()
            writer.add_batch(rows, tokens, torch.ones(len(rows), NUM_TOKENS), embeddings[start : start + len(rows)])
    finalize_store(directory, [f"video{i:07d}.mp4" for i in range(count)], 1, info)


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """p50 and p95 in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    return statistics.median(ms), ms[min(len(ms) - 1, int(round(0.95 * (len(ms) - 1))))]


def time_each(function, items) -> list[float]:
    times = []
    for item in items:
        start = time.perf_counter()
        function(item)
        times.append(time.perf_counter() - start)
    return times


def top_k_overlap(found: torch.Tensor, expected: torch.Tensor) -> float:
    """The share of the exact top-k that the first stage found (what ANN papers call recall@k; not the retrieval
    metric of train/metrics, which scores ranked positives)."""
    k = expected.shape[1]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(found.tolist(), expected.tolist())]))


def exact_top_k(queries: torch.Tensor, embeddings: torch.Tensor, k: int, chunk: int = 200_000) -> torch.Tensor:
    """Exact top-k rows by float32 inner product, over the collection in chunks (the reference)."""
    best_scores = torch.full((queries.shape[0], k), float("-inf"))
    best_rows = torch.zeros(queries.shape[0], k, dtype=torch.long)
    for start in range(0, embeddings.shape[0], chunk):
        scores = queries @ embeddings[start : start + chunk].T
        top = scores.topk(min(k, scores.shape[1]), dim=1)
        merged_scores = torch.cat([best_scores, top.values], dim=1)
        merged_rows = torch.cat([best_rows, top.indices + start], dim=1)
        order = merged_scores.topk(k, dim=1).indices
        best_scores, best_rows = merged_scores.gather(1, order), merged_rows.gather(1, order)
    return best_rows


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def anonymous_bytes() -> int:
    """The process's anonymous resident memory (`RssAnon`, Linux): what it allocated and copied, unlike the pages of
    memory-mapped files that RSS also counts (page cache shared with the OS, not copies). 0 where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(size: int, kind: str | None, args, pipe: VideoTextRetrievalPipeline, root: Path) -> dict:
    """One row of the table: build, open, latency, recall (and search latency with and without re-ranking)."""
    store = root / f"store-{size}"
    embeddings = unit_vectors(size, DIM, seed=size)
    if not (store / "video_store.json").is_file():
        vision = pipe.model.config.vision_config
        write_synthetic_store(store, embeddings, {
            "projection_dim": DIM, "temporal_reduction": vision.temporal_reduction_per_layer,
            "spatial_reduction": vision.spatial_reduction_per_layer})
    queries = unit_vectors(args.queries, DIM, seed=7)
    expected = exact_top_k(queries, embeddings, 10)
    del embeddings

    index = VideoIndex.load(store, first_stage=False)
    start = time.perf_counter()
    stage = index.build_first_stage(kind=kind, progress_bar=False)
    build_seconds = time.perf_counter() - start
    index.save_first_stage()
    saved = store / FIRST_STAGE_FILE
    stage_bytes = saved.stat().st_size if saved.is_file() else int(index.num_encoded * DIM * 4)  # flat: the vectors
    del index, stage

    rss_before, anonymous_before = rss_bytes(), anonymous_bytes()
    start = time.perf_counter()
    index = VideoIndex.load(store)
    open_seconds = time.perf_counter() - start
    open_rss, open_anonymous = rss_bytes() - rss_before, anonymous_bytes() - anonymous_before
    if index.first_stage is None:  # the exact stage is not saved: built on the first search
        index.build_first_stage(kind=kind, progress_bar=False)
    reopened_kind = index.first_stage.kind

    found = torch.cat([index.nearest(queries[q : q + 1], k=10)[1] for q in range(len(queries))])
    nearest_times = time_each(lambda q: index.nearest(queries[q : q + 1], k=10), range(len(queries)))
    row = {
        "videos": size, "kind": reopened_kind, "build_s": build_seconds, "stage_bytes": stage_bytes,
        "open_s": open_seconds, "open_rss_bytes": open_rss, "open_anonymous_bytes": open_anonymous,
        "recall_at_10": top_k_overlap(found, expected),
        "first_stage_ms": percentiles(nearest_times),
    }
    if not args.no_rerank:
        texts = [QUERY_TEXTS[q % len(QUERY_TEXTS)] + f" {q}" for q in range(len(queries))]
        plain = time_each(lambda text: pipe.search(text, index, top_k=10, rerank=False), texts)
        reranked = time_each(lambda text: pipe.search(text, index, top_k=10, rerank=True, rerank_k=16), texts)
        row["search_ms"], row["search_rerank16_ms"] = percentiles(plain), percentiles(reranked)
    print(json.dumps(row), flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    print("\n| videos | first stage | build s | stage MB | open s | open RSS / anonymous MB | recall@10 | "
          "nearest p50 / p95 ms | search p50 / p95 ms | search + re-rank 16 p50 / p95 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pair = lambda key: "%.2f / %.2f" % r[key] if key in r else "-"  # noqa: E731
        print(f"| {r['videos']:,} | {r['kind']} | {r['build_s']:.1f} | {r['stage_bytes'] / 2**20:.0f} | "
              f"{r['open_s']:.2f} | {r['open_rss_bytes'] / 2**20:.0f} / {r['open_anonymous_bytes'] / 2**20:.0f} | "
              f"{r['recall_at_10']:.3f} | "
              f"{pair('first_stage_ms')} | {pair('search_ms')} | {pair('search_rerank16_ms')} |")
    by_size = {r["videos"]: r for r in rows if r["kind"] in ("flat", "pq")}
    if 100_000 in by_size and 1_000_000 in by_size:
        growth = by_size[1_000_000]["first_stage_ms"][0] / by_size[100_000]["first_stage_ms"][0]
        print(f"\nnearest p50 growth from 100k to 1M: {growth:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--kinds", nargs="+", default=[None],
                        help="first-stage kinds to measure (default: the index's own choice by size)")
    parser.add_argument("--queries", type=int, default=200, help="queries timed one at a time")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-rerank", action="store_true", help="skip the pipeline search columns")
    parser.add_argument("--recall-200k", action="store_true",
                        help="only the first stage's recall@10 (and build) on a 200k set: --sizes 200000 --no-rerank")
    parser.add_argument("--workdir", type=Path, help="where the synthetic stores go (default: a temporary folder)")
    args = parser.parse_args()
    if args.recall_200k:
        args.sizes, args.no_rerank = [200_000], True
    if faiss_module() is None:
        raise SystemExit("This benchmark measures the FAISS first stage: pip install faiss-cpu.")
    torch.set_num_threads(args.threads)
    faiss_module().omp_set_num_threads(args.threads)
    print(f"threads={args.threads}, exact first stage up to {EXACT_MAX_VIDEOS:,} videos, {args.queries} queries, "
          f"cpu={os.cpu_count()} logical, peak RSS so far {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} KB")
    pipe = tiny_pipeline()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        for size in args.sizes:
            for kind in args.kinds:
                rows.append(measure(size, None if kind in (None, "default") else kind, args, pipe, Path(root)))
    print_table(rows)


if __name__ == "__main__":
    main()
