"""Soak test of a video-encoder runtime in a long-lived process: the app's own functions (`app/app.py`:
`load_state`, `index_videos`, `search_videos`) serving with the OpenVINO runtime for several minutes, mixed with
PyTorch work in the same process (training steps with backward, a DataLoader whose workers fork this process), then
a clean exit. The model is saved again with this checkout's code first (the app runs a folder's own code copy).

    python -m benchmarks.soak_runtime --minutes 4                     # the app's default: the engine in a worker
    python -m benchmarks.soak_runtime --minutes 4 --in-process        # the engine inside this process
    python -m benchmarks.soak_runtime --model DIR --videos DIR --backend onnxruntime --precision int8

Every round indexes a folder that grows by a few videos (the app grows the index of the same folder), runs the
searches, checks that each query's ranking equals the one of the first round over the videos both indexed (the
runtime gives the same answers all along), takes two training steps and iterates a DataLoader with 2 workers. It
prints one line per round and a JSON summary (rounds, searches, videos encoded, worker starts, resident memory
first/last), and exits with status 0 only if every round passed; the shell's ``$?`` then says whether the process
also exited cleanly (no crash at exit). Defaults: the demo's model (b) and test videos (`make demo`).
"""

import argparse
import importlib.util
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
QUERIES = ["a red square flashes on a white screen.", "first the screen is blue. then the screen is green.",
           "a yellow square flashes.", "finally the screen is purple."]


def load_app():
    spec = importlib.util.spec_from_file_location("testa_app", REPO / "app" / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resident_mib() -> float:
    """This process's peak resident memory (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def torch_work(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> float:
    """Two training steps of a small video encoder, then a DataLoader with 2 forked workers; returns the loss."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    for _ in range(2):
        video = torch.randn(2, config.num_frames, 3, config.image_size, config.image_size, generator=generator)
        loss = model(video).last_hidden_state.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    data = TensorDataset(torch.randn(64, 8, generator=generator))
    total = sum(float(batch[0].sum()) for batch in DataLoader(data, batch_size=8, num_workers=2))
    if not torch.isfinite(torch.tensor(total)):
        raise RuntimeError("the DataLoader workers returned non-finite data")
    return float(loss.detach())


def rankings(app, state, top_k: int) -> dict[str, list[str]]:
    result = {}
    for query in QUERIES:
        _, rows, _ = app.search_videos(state, query, top_k, rerank=False)
        result[query] = [row[1] for row in rows]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "outputs/demo/runs/b/final"))
    parser.add_argument("--videos", default=str(REPO / "outputs/demo/data/videos"))
    parser.add_argument("--backend", default="openvino")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--in-process", action="store_true", help="run the engine in this process (not isolated)")
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--first", type=int, default=16, help="videos indexed in the first round")
    parser.add_argument("--grow", type=int, default=4, help="videos added to the folder every round")
    args = parser.parse_args(argv)

    from modeling_testa import TestaVisionConfig, TestaVisionModel
    from modeling_testa.video_inputs import find_video_files

    from modeling_testa import TestaForVideoTextRetrieval
    from modeling_testa.processing_testa import TestaProcessor

    # the app loads the model folder's own code copy (trust_remote_code): save it again with this checkout's code
    model_folder = Path(tempfile.mkdtemp(prefix="testa-soak-model-"))
    TestaForVideoTextRetrieval.from_pretrained(args.model).save_pretrained(model_folder)
    TestaProcessor.from_pretrained(args.model).save_pretrained(model_folder)
    app = load_app()
    if args.in_process:  # what the app passes, with isolation off
        import testa_runtimes

        testa_runtimes.isolated_by_default = lambda backend, device="cpu": False  # the name the app reads
    state = app.load_state(str(model_folder), None, None, args.precision, args.backend)
    if state.retrieval is None:
        print(f"error: {state.model_error}", file=sys.stderr)
        return 2
    settings = state.retrieval.model.inference_settings
    print(f"runtime: {settings}", flush=True)
    videos = sorted(find_video_files(args.videos)[0])
    folder = Path(tempfile.mkdtemp(prefix="testa-soak-"))
    trained = TestaVisionModel(TestaVisionConfig(num_frames=4, image_size=32, patch_size=8, hidden_size=32,
                                                 num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                                 temporal_reduction=1, spatial_reduction=3)).train()
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    deadline = time.monotonic() + 60 * args.minutes
    first_rankings, first_names, linked, rounds, searches, memory = None, set(), 0, 0, 0, [resident_mib()]
    started = time.monotonic()
    while time.monotonic() < deadline:
        add = args.first if rounds == 0 else args.grow
        for video in videos[linked:linked + add]:
            (folder / Path(video).name).symlink_to(video)
        linked = min(len(videos), linked + add)
        report = app.index_videos(state, str(folder), None)
        current = rankings(app, state, top_k=5)
        searches += len(QUERIES)
        if first_rankings is None:
            first_rankings, first_names = current, {Path(video).name for video in state.served.indexed}
        for query, ranked in current.items():  # among the first round's videos, the order must stay the same
            kept = [name for name in ranked if name in first_names]
            if kept != first_rankings[query][:len(kept)]:
                raise SystemExit(f"round {rounds}: the ranking of {query!r} changed: {ranked} (first round: "
                                 f"{first_rankings[query]})")
        loss = torch_work(trained, optimizer, seed=rounds)
        rounds += 1
        memory.append(resident_mib())
        print(f"[{time.monotonic() - started:6.1f} s] round {rounds}: {report.splitlines()[0]}; {len(QUERIES)} "
              f"searches; training loss {loss:.4f}; peak RSS {memory[-1]:.0f} MiB", flush=True)
        if linked == len(videos):  # every video indexed: start again from a new folder
            folder, linked, first_rankings = Path(tempfile.mkdtemp(prefix="testa-soak-")), 0, None
            print(f"round {rounds}: every video indexed; a new folder from now on", flush=True)
    runtime = state.retrieval.model.vision_model.runtime
    process = getattr(runtime, "process", None)
    summary = {"runtime": settings, "minutes": round((time.monotonic() - started) / 60, 2), "rounds": rounds,
               "searches": searches, "videos_indexed_last": len(state.served.index) if state.served.index else 0,
               "worker_starts": process.starts if process else None, "peak_rss_mib_first_round": round(memory[1]),
               "peak_rss_mib_last_round": round(memory[-1]), "pid": os.getpid()}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
