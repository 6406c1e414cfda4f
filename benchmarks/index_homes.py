"""The same embeddings in two homes: the in-process first stage (a video store opened by `VideoIndex.load`, FAISS) and
Milvus (`milvus.MilvusHome` on a `milvus-lite server` bound to 127.0.0.1, over gRPC).

    python -m benchmarks.index_homes                       # 100k 256-d vectors, 200 queries in process, 100 in Milvus
    python -m benchmarks.index_homes --sizes 100000 1000000

The collection: N random L2-normalised 256-d vectors (no clusters: the worst case for an approximate index's recall),
one row per video. Per home it reports:

- build: seconds from the embeddings to a searchable index. In process: writing the store (one shard, tiny tokens)
  and building + saving its first stage (`VideoIndex.save_first_stage`: fast-scan PQ above 50,000 videos). Milvus:
  upserting every row (payload: video, folder, dataset, start/end) in chunks of 5,000, `flush`, and loading the
  collection with its HNSW index (M=16, efConstruction=100);
- open: seconds to make the home searchable again in a fresh handle (`VideoIndex.load` of the store and its saved
  stage; a new `MilvusClient` and `load_collection`);
- p50 / p95 ms per query (one query at a time: `VideoIndex.nearest(q, 10)` / `MilvusIndex.nearest(q, 10)`, which
  fetches the ten rows' payload and vectors too), and recall@10 against exact float32 search.

Milvus Lite is for development: its numbers are not a Milvus cluster's (whose engine is C++ and distributed). The
numbers depend on the machine and its load; `--threads` (default 2) sets torch's and FAISS's threads.
"""

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.search_scale import exact_top_k, percentiles, top_k_overlap, write_synthetic_store
from testa_search.milvus import MilvusHome, row_payload
from testa_search.index import VideoIndex, faiss_module

DIM = 256


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(data: Path) -> tuple[subprocess.Popen, str]:
    """A `milvus-lite server` on a free loopback port (never 0.0.0.0)."""
    port = free_port()
    process = subprocess.Popen([str(Path(sys.executable).with_name("milvus-lite")), "server", "--host", "127.0.0.1",
                                "--port", str(port), "--data-dir", str(data)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process, f"http://127.0.0.1:{port}"
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("milvus-lite server did not start")


def in_process(directory: Path, embeddings: torch.Tensor, queries: torch.Tensor, truth: torch.Tensor) -> dict:
    begin = time.perf_counter()
    write_synthetic_store(directory, embeddings, {"projection_dim": DIM})
    VideoIndex.load(directory, first_stage=False).save_first_stage(directory)
    build = time.perf_counter() - begin
    begin = time.perf_counter()
    index = VideoIndex.load(directory)
    index.nearest(queries[:1], 10)  # the first search builds an exact stage that was not saved (<= 50k)
    opened = time.perf_counter() - begin
    times, found = [], []
    for query in queries:
        start = time.perf_counter()
        _, rows = index.nearest(query[None], 10)
        times.append(time.perf_counter() - start)
        found.append(rows[0])
    p50, p95 = percentiles(times)
    kind = index.first_stage.kind if index.first_stage is not None else "torch"
    return {"home": f"in process ({kind})", "build_s": build, "open_s": opened, "p50_ms": p50, "p95_ms": p95,
            "recall@10": top_k_overlap(torch.stack(found), truth[: len(found)])}


def milvus(uri: str, embeddings: torch.Tensor, queries: torch.Tensor, truth: torch.Tensor, chunk: int = 5000) -> dict:
    params = {"index_type": "HNSW", "params": {"M": 16, "efConstruction": 100}}
    home = MilvusHome(uri, "bench", dim=DIM, index_params=params, search_params={"ef": 128})
    if home.client.has_collection("bench"):
        home.client.drop_collection("bench")
    begin = time.perf_counter()
    home.check_settings({"model_class": "benchmark", "projection_dim": DIM})  # creates the collection
    for start in range(0, embeddings.shape[0], chunk):
        rows = [row_payload(f"/videos/set{i % 4}/video{i:07d}.mp4", None, None, f"set{i % 4}", embeddings[i])
                for i in range(start, min(start + chunk, embeddings.shape[0]))]
        home.upsert(rows)
    index = home.open()
    index.nearest(queries[:1], 10)  # the index is built by the first search at the latest
    build = time.perf_counter() - begin
    begin = time.perf_counter()
    again = MilvusHome(uri, "bench", dim=DIM, search_params={"ef": 128}).open()
    opened = time.perf_counter() - begin
    times, found = [], []
    for query in queries:
        start = time.perf_counter()
        _, rows = again.nearest(query[None], 10)
        times.append(time.perf_counter() - start)
        found.append([int(again.hits[int(r)]["video"][-11:-4]) for r in rows[0]])
    p50, p95 = percentiles(times)
    return {"home": "Milvus Lite server (HNSW, gRPC)", "build_s": build, "open_s": opened, "p50_ms": p50,
            "p95_ms": p95, "recall@10": top_k_overlap(torch.tensor(found), truth[: len(found)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--queries", type=int, default=200, help="queries in process (Milvus: half)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    faiss = faiss_module()
    if faiss is not None:
        faiss.omp_set_num_threads(args.threads)
    results = []
    work = Path(tempfile.mkdtemp(prefix="index-homes-"))
    server, uri = start_server(work / "milvus")
    try:
        for size in args.sizes:
            generator = torch.Generator().manual_seed(size)
            embeddings = F.normalize(torch.randn(size, DIM, generator=generator), dim=1)
            queries = F.normalize(torch.randn(args.queries, DIM, generator=generator), dim=1)
            truth = exact_top_k(queries, embeddings, 10)
            for row in (in_process(work / f"store-{size}", embeddings, queries, truth),
                        milvus(uri, embeddings, queries[: args.queries // 2], truth)):
                row["videos"] = size
                results.append(row)
                print(json.dumps(row), flush=True)
            shutil.rmtree(work / f"store-{size}", ignore_errors=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)
    print("\n| videos | home | build s | open s | p50 ms | p95 ms | recall@10 |\n|---|---|---|---|---|---|---|")
    for row in results:
        print(f"| {row['videos']:,} | {row['home']} | {row['build_s']:.1f} | {row['open_s']:.2f} | "
              f"{row['p50_ms']:.2f} | {row['p95_ms']:.2f} | {row['recall@10']:.3f} |")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
