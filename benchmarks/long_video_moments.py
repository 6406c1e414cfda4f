"""Moment retrieval in long videos: one embedding per video, windows, and windows refined with TESTA's segments.

Data: `processing.long_videos` (black videos of several minutes with short-event videos at known times; one query per
event, its paragraph), generated into a temporary folder unless `--data` names one. Every query searches every video
(video-corpus moment retrieval); the scores are those of the `train/metrics/moment_retrieval` module through
`train.moment_evaluation` (R1@IoU 0.3/0.5/0.7, mIoU, video-level R@1).

Methods:

* `whole video`: one embedding per video (the model's frames spread over the whole video, as indexing does by
  default); its moment is the whole video. Encodes 1/W of what the windows encode (W windows per video);
* `mean of windows`: one embedding per video, the mean of its window embeddings, ranked by cosine; the same compute
  as the windows;
* `windows`: `encode_videos(paths, window=, stride=)`, one row per window, two-stage search; the moment is the best
  window;
* `windows + TESTA segments`: the best window and the windows of the same video that overlap it are run through the
  encoder again with source tracking; every frame is scored by the similarity of the query with the TESTA regions its
  patches were merged into (`grounding.ground_phrases`), and the moment becomes the run of frames around the best one
  scoring above half-way (`moments.refine_moment`): it trims or extends the window. It costs the encoder passes of
  those windows per query (timed).

Timing: the indexing wall time of each method, per hour of video (total time / total duration x 3600), with the
process pinned to one core.

    python -m benchmarks.long_video_moments --model outputs/demo/runs/b/final
    python -m benchmarks.long_video_moments --model M --num-videos 8 --minutes 4 --events 3 --window 30 --stride 15
"""

import argparse
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from modeling_testa import TestaProcessor, VideoTextRetrievalPipeline
from modeling_testa.grounding import ground_phrases
from testa_search.moments import frame_spans, refine_moment, window_pixel_values
from processing.long_videos import generate_long_videos_dataset
from testa_search.cli.index import load_retrieval_model
from train.moment_evaluation import moment_queries, score_moment_search


METRICS = ("R1@0.3", "R1@0.5", "R1@0.7", "mIoU", "video_R@1")


def load_rows(data: str) -> list[dict]:
    with open(os.path.join(data, "test.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [dict(row, video=os.path.join(data, row["video"])) for row in rows]


@torch.no_grad()
def mean_of_windows(pipe, windows_index, queries: list[str]) -> list[list[dict]]:
    """Every video's mean window embedding, ranked by cosine; whole-video moments."""
    names = list(dict.fromkeys(windows_index.names))
    rows = {name: [i for i, n in enumerate(windows_index.names) if n == name] for name in names}
    videos = F.normalize(torch.stack([windows_index.embeddings[rows[n]].mean(0) for n in names]), dim=-1)
    tokens = pipe.processor(text=queries, return_tensors="pt")
    text = pipe.model.get_text_features(tokens["input_ids"], tokens["attention_mask"]).pooler_output
    scores = text.float() @ videos.T
    return [[{"video": names[i], "start": None, "end": None, "score": float(s[i])} for i in s.argsort(descending=True)]
            for s in scores]


@torch.no_grad()
def refine_with_segments(pipe, query: str, best: dict, windows_index) -> tuple[float, float]:
    """The best moment trimmed or extended with TESTA's segments (see the module docstring)."""
    window, stride = windows_index.info["window"], windows_index.info["stride"]
    cut, pixel_values = window_pixel_values(pipe.video_processor, best["video"], window, stride)
    spans, scores = [], []
    for (start, end), clip in zip(cut.windows, pixel_values):
        if end <= best["start"] or start >= best["end"]:
            continue  # only the best window and the ones overlapping it
        grounding = ground_phrases(pipe.model, pipe.processor, clip[None], [query])
        per_frame = grounding.patch_similarity()[0].nanmean(dim=1)  # (frames,)
        spans += frame_spans(start, end, clip.shape[0])
        scores += per_frame.tolist()
    return refine_moment(spans, scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a retrieval model folder (e.g. the demo's runs/b/final)")
    parser.add_argument("--data", default=None, help="a processing.long_videos folder (default: generate one)")
    parser.add_argument("--num-videos", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=4)
    parser.add_argument("--events", type=int, default=3, help="events per video")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--stride", type=float, default=15.0)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    model, _ = load_retrieval_model(args.model)
    pipe = VideoTextRetrievalPipeline(model=model, processor=TestaProcessor.from_pretrained(args.model), device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or tmp
        if args.data is None:
            generate_long_videos_dataset(tmp, args.num_videos, args.minutes, args.events, args.seed)
        rows = load_rows(data)
        built = moment_queries(rows)
        texts = [q.text for q in built.queries]
        paths = [row["video"] for row in rows]
        hours = sum(row["duration"] for row in rows) / 3600

        begin = time.perf_counter()
        whole_index = pipe.encode_videos(paths, progress_bar=False)
        whole_seconds = time.perf_counter() - begin
        begin = time.perf_counter()
        windows_index = pipe.encode_videos(paths, window=args.window, stride=args.stride, progress_bar=False)
        windows_seconds = time.perf_counter() - begin
        frames = pipe.video_processor.num_frames
        per_video_windows = len(windows_index) / len(paths)

        results = {
            "whole video": [[dict(r, start=None, end=None) for r in ranked]
                            for ranked in pipe.search(texts, whole_index, top_k=None)],
            "mean of windows": mean_of_windows(pipe, windows_index, texts),
            "windows": pipe.search(texts, windows_index, top_k=10),
        }
        begin = time.perf_counter()
        refined = []
        for text, ranked in zip(texts, results["windows"]):
            start, end = refine_with_segments(pipe, text, ranked[0], windows_index)
            refined.append([dict(ranked[0], start=start, end=end)] + ranked[1:])
        refine_seconds = (time.perf_counter() - begin) / len(texts)
        results["windows + TESTA segments"] = refined

    scores = {name: score_moment_search(built.queries, ranked, video_ks=(1,)) for name, ranked in results.items()}
    windowed = per_video_windows * frames
    compute = {"whole video": frames, "mean of windows": windowed, "windows": windowed,
               "windows + TESTA segments": windowed}
    per_hour = {"whole video": whole_seconds / hours, "mean of windows": windows_seconds / hours,
                "windows": windows_seconds / hours, "windows + TESTA segments": windows_seconds / hours}
    print(f"{len(paths)} videos of {args.minutes:g} min, {len(texts)} queries (one per event); windows of "
          f"{args.window:g} s every {args.stride:g} s ({per_video_windows:.0f} per video), {frames} frames each; "
          "one core\n")
    print("| method | frames encoded per video | R1@0.3 | R1@0.5 | R1@0.7 | mIoU | video R@1 | indexing s per hour of "
          "video |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, values in scores.items():
        print(f"| {name} | {compute[name]:.0f} | " + " | ".join(f"{values[m]:.1f}" for m in METRICS)
              + f" | {per_hour[name]:.0f} |")
    print(f"\nrefining with TESTA segments: {1000 * refine_seconds:.0f} ms per query (decoding the best window's video "
          "once and encoding the windows overlapping the best one)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "scores": scores, "frames_per_video": compute,
                       "indexing_seconds_per_hour": per_hour, "refine_seconds_per_query": refine_seconds}, f, indent=1)


if __name__ == "__main__":
    main()
