"""Do the runtimes agree? One trained model, its videos, PyTorch fp32 eager against every other runtime, with the
merge decisions on snapped scores (the model's `score_grid`, set per run with `set_aggregation`) and, for the
"before", on raw scores.

    python -m benchmarks.runtime_agreement --model outputs/demo/runs/b/final --data outputs/demo/data \\
        [--split all] [--runtimes openvino-fp32 onnxruntime-fp32 openvino-int8 openvino-bf16 compile-fp32 \\
        compile-bf16 torch-bf16] [--grids off 10] [--queries 5] [--json PATH] [--retrieval]

For every grid (``off``: raw scores, as before snapping; an integer k: scores snapped to multiples of 2^-k) and every
runtime, over the videos of ``--split`` (``all``: every row of the data folder's train.jsonl and test.jsonl; decoded
once, 16 uniformly sampled frames as the evaluation samples them):

* **identical merge decisions**: the share of videos whose source map (the output token of every input patch) and
  token sizes equal PyTorch eager fp32's at the same grid;
* **embedding cosine**: the contrastive video embedding (`get_video_features` of the encoder's tokens) against
  eager fp32's: the minimum over videos, and how many videos fall below 0.9999 and 0.99;
* the largest absolute difference of the encoder's output tokens (over the videos with identical decisions, and
  over all videos);
* **top-10 overlap** for ``--queries`` text queries (the first test captions; text embeddings in PyTorch fp32, the
  same for every runtime): how many of eager fp32's ten nearest videos the runtime also ranks in its ten.

Runtimes: ``openvino-fp32``, ``onnxruntime-fp32`` and ``openvino-int8`` / ``onnxruntime-int8`` (the exported encoder,
`optimize_for_inference(..., backend=...)`; int8 calibrated on ``--calibration-videos`` videos of the train split),
``openvino-bf16`` (OpenVINO bf16: the linear layers in bf16, the rest in fp32, `linear_layers_in_bf16`; needs
AVX-512 BF16 or AMX), ``torch-bf16`` (bf16 linears in PyTorch), ``compile-fp32`` / ``compile-bf16``
(`optimize_for_inference(..., compile=True)`: every encoder block compiled by TorchInductor). Each grid exports into
its own cache folder under ``--cache-dir`` (the export cache's key includes the grid too; separate folders keep
every grid's engines on disk for a rerun).

``--retrieval`` also runs the demo's own test-split evaluation (the code path of the demo table,
`train.evaluation.evaluate_retrieval` with the demo's recipe) once per grid and prints R@1/5/10 in both directions;
``--noise-draws N`` repeats it on pixels scaled by 1 + k * 1e-6 (k = 1..N), which shows how much of a difference is
fp32's own noise.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import modeling_testa.aggregation as aggregation
from modeling_testa import TestaForVideoTextRetrieval
from testa_runtimes import optimize_for_inference
from modeling_testa.aggregation import DEFAULT_SCORE_GRID
from modeling_testa.processing_testa import TestaProcessor

RUNTIMES = ("openvino-fp32", "onnxruntime-fp32", "openvino-int8", "onnxruntime-int8", "openvino-bf16", "torch-bf16",
            "compile-fp32", "compile-bf16")
DEFAULT_RUNTIMES = ("openvino-fp32", "onnxruntime-fp32", "openvino-int8", "openvino-bf16", "compile-fp32",
                    "compile-bf16")


def grid_value(name: str) -> float:
    """``"off"`` -> 0 (raw scores); ``"k"`` -> 2^-k."""
    return 0.0 if name == "off" else 2.0 ** -int(name)


def read_rows(data_dir: Path, split: str) -> list[dict]:
    """The rows of ``split`` (``all``: train then test), one per video."""
    splits = ("train", "test") if split == "all" else (split,)
    rows, seen = [], set()
    for name in splits:
        for line in (data_dir / f"{name}.jsonl").read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row["video"] not in seen:
                    seen.add(row["video"])
                    rows.append(row)
    return rows


def decode(processor: TestaProcessor, data_dir: Path, rows: list[dict]) -> torch.Tensor:
    """``(videos, frames, 3, H, W)`` pixel values, uniformly sampled as the evaluation does."""
    frames = processor.video_processor.num_frames
    videos = [processor.video_processor(videos=[str(data_dir / row["video"])], num_frames=frames,
                                        frame_sampling="uniform")["pixel_values"] for row in rows]
    return torch.cat(videos)


@torch.no_grad()
def encode(model: TestaForVideoTextRetrieval, pixel_values: torch.Tensor, batch_size: int = 16) -> dict:
    """Source maps, token sizes, output tokens and contrastive embeddings of every video."""
    parts = {"source_map": [], "token_sizes": [], "tokens": [], "embeddings": []}
    for start in range(0, len(pixel_values), batch_size):
        out = model.get_video_tokens(pixel_values[start : start + batch_size], trace_source=True)
        features = model.get_video_features(video_tokens=out.last_hidden_state.float(),
                                            video_token_sizes=out.token_sizes)
        parts["source_map"].append(out.source_map)
        parts["token_sizes"].append(out.token_sizes.float())
        parts["tokens"].append(out.last_hidden_state.float())
        parts["embeddings"].append(features.pooler_output.float())
    return {name: torch.cat(values) for name, values in parts.items()}


@torch.no_grad()
def boundary_margins(model: TestaForVideoTextRetrieval, pixel_values: torch.Tensor, batch_size: int = 16
                     ) -> torch.Tensor:
    """For every video, how close PyTorch eager's deciding scores come to a boundary between grid cells: the
    minimum, over every row of scores the matcher snaps (an A token against all B tokens, every block, frames and
    patches), of the distance of the row's best and second-best score to the nearest boundary. A runtime can only
    flip a decision by moving one of those scores across a boundary, so a video whose margin exceeds the runtimes'
    score differences keeps its decisions; an upper bound on the flips, since a flip also needs the two best to
    share or neighbour a cell."""
    grid = model.config.vision_config.score_grid
    margins = []
    recorded: list[torch.Tensor] = []
    round_to_grid = aggregation.round_to_grid

    def recording_round(scaled: torch.Tensor) -> torch.Tensor:  # scores in grid steps: boundaries at k + 1/2
        top = scaled.topk(min(2, scaled.shape[-1]), dim=-1).values if scaled.ndim > 2 else scaled.unsqueeze(-1)
        top = top.double()
        distance = ((top - top.floor()) - 0.5).abs() * grid  # 0.5 - |...| from the centre = distance to a boundary
        distance = torch.where(torch.isfinite(top), distance, torch.inf)
        recorded.append(distance.flatten(1).amin(1))
        return round_to_grid(scaled)

    aggregation.round_to_grid = recording_round
    try:
        for start in range(0, len(pixel_values), batch_size):
            recorded.clear()
            model.get_video_tokens(pixel_values[start : start + batch_size])
            margins.append(torch.stack(recorded).amin(0))
    finally:
        aggregation.round_to_grid = round_to_grid
    return torch.cat(margins).float()


def runtime_model(model, runtime: str, cache_dir: Path, calibration: torch.Tensor):
    """A copy of ``model`` prepared for ``runtime``."""
    model = copy.deepcopy(model)
    if runtime.startswith("compile-"):
        return optimize_for_inference(model, runtime.split("-")[1], compile=True)
    if runtime == "torch-bf16":
        return optimize_for_inference(model, "bf16")
    backend, precision = runtime.split("-")
    return optimize_for_inference(model, precision, backend=backend, cache_dir=cache_dir,
                                  calibration=calibration if precision == "int8" else None)


def compare(reference: dict, result: dict, query_embeddings: torch.Tensor, k: int = 10) -> dict:
    """The agreement measures of the module docstring, ``result`` against ``reference``."""
    same = (result["source_map"] == reference["source_map"]).flatten(1).all(1)
    same &= (result["token_sizes"] == reference["token_sizes"]).flatten(1).all(1)
    cosine = F.cosine_similarity(result["embeddings"], reference["embeddings"], dim=-1)
    difference = (result["tokens"] - reference["tokens"]).abs().flatten(1).amax(1)
    k = min(k, len(cosine))
    top_reference = (query_embeddings @ reference["embeddings"].T).topk(k, dim=-1).indices
    top_result = (query_embeddings @ result["embeddings"].T).topk(k, dim=-1).indices
    overlap = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_reference, top_result)]
    return {"videos": len(same), "identical_decisions": int(same.sum()),
            "identical_share": float(same.float().mean()), "min_cosine": float(cosine.min()),
            "below_0.9999": int((cosine < 0.9999).sum()), "below_0.99": int((cosine < 0.99).sum()),
            "max_diff_identical": float(difference[same].max()) if same.any() else None,
            "max_diff": float(difference.max()), "top10_overlap": overlap}


def table(results: list[dict]) -> str:
    lines = ["| runtime vs PyTorch eager fp32 | score grid | identical merge decisions | min embedding cosine | "
             "videos < 0.9999 / < 0.99 | max token diff (identical decisions / all) | top-10 overlap per query |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        grid = "raw scores (before)" if r["grid"] == "off" else f"2^-{r['grid']}"
        same_diff = "-" if r["max_diff_identical"] is None else f"{r['max_diff_identical']:.1e}"
        lines.append(f"| {r['runtime']} | {grid} | {r['identical_decisions']}/{r['videos']} "
                     f"({100 * r['identical_share']:.1f}%) | {r['min_cosine']:.6f} | {r['below_0.9999']} / "
                     f"{r['below_0.99']} | {same_diff} / {r['max_diff']:.2e} | "
                     f"{', '.join(map(str, r['top10_overlap']))} |")
    return "\n".join(lines)


def evaluate(model_dir: Path, data_dir: Path, grid: str, pixel_factor: float = 1.0) -> dict:
    """The demo's test-split evaluation (`train.demo.evaluate_variant`'s code path: `train.evaluation`) with the model
    deciding on the grid ``grid`` (`grid_value`), the pixels scaled by ``pixel_factor`` before the encoder (1 + 1e-6:
    fp32's own noise)."""
    from accelerate import Accelerator

    from benchmarks.fast_inference import perturb_pixels
    from train.demo import load_recipe
    from train.evaluation import evaluate_retrieval

    recipe = load_recipe()
    recipe["data"]["dataset"] = str(data_dir)
    model = TestaForVideoTextRetrieval.from_pretrained(str(model_dir)).eval()
    model.set_aggregation(score_grid=grid_value(grid))
    processor = TestaProcessor.from_pretrained(str(model_dir))
    recipe["data"]["num_frames"] = processor.video_processor.num_frames
    if pixel_factor != 1.0:
        model.vision_model.register_forward_pre_hook(perturb_pixels(pixel_factor), with_kwargs=True)
    return evaluate_retrieval(model, processor, recipe, Accelerator(cpu=True))


def retrieval(model_dir: Path, data_dir: Path, grids: list[str], noise_draws: int = 0) -> list[dict]:
    """The demo's test-split R@k at every grid, and on pixels scaled by 1 + k * 1e-6 for k = 1..``noise_draws``."""
    rows = []
    for grid in grids:
        for k in range(noise_draws + 1):
            metrics = evaluate(model_dir, data_dir, grid, 1 + k * 1e-6)
            recall = {key: metrics[key] for key in sorted(metrics) if "_R@" in key and "chance" not in key}
            rows.append({"grid": grid, "pixels": f"x (1 + {k}e-6)" if k else "as decoded", **recall})
            print(f"grid {grid}, pixels {rows[-1]['pixels']}: " + ", ".join(f"{key} {value:.1f}"
                                                                         for key, value in recall.items()), flush=True)
    return rows


def agreement_at_grid(args: argparse.Namespace, grid: str, model, pixel_values: torch.Tensor,
                      calibration: torch.Tensor, queries: torch.Tensor, report: dict) -> list[dict]:
    """Every runtime against PyTorch eager fp32, the model deciding on the grid ``grid`` (`grid_value`); boundary
    margins into ``report``."""
    model.set_aggregation(score_grid=grid_value(grid))
    results = []
    reference = encode(model, pixel_values)
    if grid != "off":
        margin = boundary_margins(model, pixel_values)
        counts = {f"{bound:g}": int((margin < bound).sum()) for bound in (1e-7, 1e-6, 1e-5, 1e-4)}
        report.setdefault("boundary_margins", {})[grid] = {"min": float(margin.min()), "videos_below": counts}
        print(f"grid 2^-{grid}: smallest distance of a deciding score to a cell boundary {margin.min():.2e}; "
              f"videos with one closer than 1e-7 / 1e-6 / 1e-5 / 1e-4: {' / '.join(map(str, counts.values()))}"
              f" of {len(margin)}", flush=True)
    for runtime in args.runtimes:
        start = time.perf_counter()
        prepared = runtime_model(model, runtime, args.cache_dir / f"grid-{grid}", calibration)
        result = compare(reference, encode(prepared, pixel_values), queries)
        result.update(runtime=runtime, grid=grid, seconds=round(time.perf_counter() - start, 1))
        results.append(result)
        print(table([result]).splitlines()[-1], f"({result['seconds']} s)", flush=True)
        del prepared
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("outputs/demo/runs/b/final"))
    parser.add_argument("--data", type=Path, default=Path("outputs/demo/data"))
    parser.add_argument("--split", default="all", help="all, train or test")
    parser.add_argument("--limit", type=int, default=None, help="at most this many videos")
    parser.add_argument("--runtimes", nargs="+", default=list(DEFAULT_RUNTIMES), choices=RUNTIMES)
    parser.add_argument("--grids", nargs="+", default=["off", str(round(-math.log2(DEFAULT_SCORE_GRID)))],
                        help="'off' (raw scores) or k for a grid of 2^-k (default: off and the library's default grid)")
    parser.add_argument("--queries", type=int, default=5)
    parser.add_argument("--calibration-videos", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=Path("outputs/runtime_agreement/engines"))
    parser.add_argument("--retrieval", action="store_true", help="also the demo's test-split R@k at every grid")
    parser.add_argument("--noise-draws", type=int, default=0,
                        help="with --retrieval, also evaluate on pixels scaled by 1 + k * 1e-6, k = 1..N")
    parser.add_argument("--no-agreement", action="store_true", help="only --retrieval")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report: dict = {"model": str(args.model), "data": str(args.data), "split": args.split, "results": []}
    if not args.no_agreement:
        model = TestaForVideoTextRetrieval.from_pretrained(str(args.model)).eval()
        processor = TestaProcessor.from_pretrained(str(args.model))
        rows = read_rows(args.data, args.split)[: args.limit]
        start = time.perf_counter()
        pixel_values = decode(processor, args.data, rows)
        calibration = decode(processor, args.data, read_rows(args.data, "train")[: args.calibration_videos])
        print(f"decoded {len(rows)} videos {tuple(pixel_values.shape[1:])} in {time.perf_counter() - start:.0f} s",
              flush=True)
        captions = [row["text"] for row in read_rows(args.data, "test")[: args.queries]]
        with torch.no_grad():
            text = processor.tokenizer(captions, padding=True, return_tensors="pt")
            queries = model.get_text_features(text["input_ids"], text["attention_mask"]).pooler_output
        report["videos"], report["queries"] = len(rows), captions
        for grid in args.grids:
            report["results"] += agreement_at_grid(args, grid, model, pixel_values, calibration, queries, report)
        print(table(report["results"]))
    if args.retrieval:
        report["retrieval"] = retrieval(args.model, args.data, args.grids, args.noise_draws)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
