"""The vision towers of Qwen2.5-VL-7B and Qwen3-VL-8B at their published sizes: tower time and peak memory, stock
transformers against TESTA inside the tower, post-encoder pruning beside it, and chunks of frames.

    python -m benchmarks.video_llm_towers                      # both towers, bf16 on the CPU (minutes)
    python -m benchmarks.video_llm_towers --json docs/video_llm_towers.json
    python -m benchmarks.video_llm_towers --quick              # tiny towers, seconds (what the test runs)
    python -m benchmarks.video_llm_towers --memory-only        # the chunked-memory rows only

The towers are built from the vision-config dimensions below (facts copied from the models' config.json files;
nothing is downloaded), with random weights, in bfloat16 where the CPU has native bf16 arithmetic
(``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo), else float32. Inputs are random patches (the tower's flattened
``pixel_values``) of ``--height`` x ``--width`` px frames, by default 112 x 112 px (Qwen3-VL: 128 x 128; 4 x 4
merge units, 64 tower tokens per tubelet, 2048 at 64 frames: small enough that the run takes about 20 minutes on a
loaded 2-core CPU, large enough that the tower's matrix products have a thousand rows or more: with far fewer rows a
CPU's bf16 product costs mostly a fixed part per call, which would hide any saving in tokens). Token counts and costs depend only on the grid, not on the pixels.

Configurations, each measured in a fresh child process (its own peak; the children run one after another):

* ``stock``: transformers' own tower (``model.visual(pixel_values, grid_thw=...)``);
* ``stock + prune``: after the same stock run (its tower time is the stock one), a post-encoder pruning step to
  TESTA's 25% token count, as the serving engines do (vLLM's EVS: a token's score is 1 - cosine similarity to the
  token at the same place in the previous tubelet, the first tubelet is kept whole, the top tokens are kept in
  order), timed on its own;
* ``testa50`` / ``testa25``: TESTA in the tower (`video_llms` adapters) with the schedule
  `video_llms.budget.plan_kept_fraction` gives for the video's grid at 50% / 25% of the video tokens kept (of its
  splits between time and space, `plan_for`, the one that keeps the most within the budget);
* ``*-chunk``: the same through ``chunk_frames`` (the tower over ``--chunk-frames`` frames at a time,
  `video_llms.qwen_tower.run_tower_chunked`); ``idle-chunk`` is TESTA with R = 0 in chunks (the stock outputs).
  With ``--chunk-offload cpu|disk`` the chunked runs hold the whole video at a temporal merge there (the adapter
  option ``chunk_offload``: a temporary file per waiting tubelet with ``disk``).

Every child builds the tower, runs it once on a 2-frame video (warm-up: kernels chosen, pools made), reads its
resident set (VmRSS: the weights, the inputs, the runtime), resets its peak (``/proc/self/clear_refs``), runs the
configuration once, timed, and reads the peak (VmHWM). **Activation peak** = that peak less the resident set before
the call. With ``--repeats N`` the same video then runs N - 1 more times, timed
(``repeat_tower_s``: the fastest): a video of a length seen before, whose every block's token count the CPU kernels
(oneDNN's bf16 ones build a kernel per new shape) have met already, as in a service that sees many videos of one
length. glibc's malloc is told to hand large blocks back to the system when freed (``MALLOC_MMAP_THRESHOLD_``), so
the resident set follows what is live. Outputs' size: the bytes of the features the tower returns (DeepStack
features included).

Reported: tower seconds, the LLM's prefill video-token count, the activation peak, and the ratios the issue's targets
name: at 64 frames and 25% kept, TESTA's tower time over stock's (target <= 0.5); at 256 frames, the chunked
activation peak over the 32-frame peak plus the 256-frame outputs (target <= 1), with and without TESTA; and the stock
tower's 256-frame peak over its 32-frame peak (about 8 expected). Times on a shared machine are noisy: the load
average is recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
from transformers.initialization import no_init_weights

from video_llms import token_grid
from video_llms.budget import plan_kept_fraction
from video_llms.common import video_settings
from video_llms.qwen2_5_vl import Qwen2_5_VLAdapter
from video_llms.qwen3_vl import Qwen3VLAdapter

# Qwen/Qwen2.5-VL-7B-Instruct, config.json "vision_config" (the tower's dimensions as published).
QWEN2_5_VL_7B_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "hidden_act": "silu",
    "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "in_chans": 3,
}
# Qwen/Qwen3-VL-8B-Instruct, config.json "vision_config".
QWEN3_VL_8B_VISION = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "hidden_act": "gelu_pytorch_tanh",
    "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24], "in_channels": 3,
}
# --quick: the same architectures, tiny.
QUICK_VISION = {
    "qwen2_5_vl": {**QWEN2_5_VL_7B_VISION, "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                   "out_hidden_size": 32, "fullatt_block_indexes": [1, 3]},
    "qwen3_vl": {**QWEN3_VL_8B_VISION, "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                 "out_hidden_size": 32, "num_position_embeddings": 16, "deepstack_visual_indexes": [1, 2]},
}
FAMILIES = {"qwen2_5_vl": ("Qwen2.5-VL-7B", QWEN2_5_VL_7B_VISION), "qwen3_vl": ("Qwen3-VL-8B", QWEN3_VL_8B_VISION)}
KEEP = {"testa50": 0.5, "testa25": 0.25}


def native_bf16() -> bool:
    """Whether the CPU does bf16 arithmetic natively (AVX-512 BF16 or AMX), from /proc/cpuinfo."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def build_tower(family: str, quick: bool, dtype: torch.dtype):
    """The vision tower of ``family`` at its published size (or tiny), random weights, eval mode, SDPA."""
    torch.manual_seed(0)
    dimensions = QUICK_VISION[family] if quick else FAMILIES[family][1]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights made in the benchmark's dtype: no float32 copy of 0.6 B parameters
    try:
        if family == "qwen2_5_vl":
            from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
            config, cls = Qwen2_5_VLVisionConfig(**dimensions), Qwen2_5_VisionTransformerPretrainedModel
        else:
            from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
            from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
            config, cls = Qwen3VLVisionConfig(**dimensions), Qwen3VLVisionModel
        config._attn_implementation = "sdpa"
        with no_init_weights():  # (buffers such as the rotary frequencies are still computed by the modules)
            tower = cls._from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    fill_random(tower)
    return tower.eval()


def fill_random(module: torch.nn.Module, std: float = 0.02) -> None:
    """Random weights, fast: matrices from one tiled pool of N(0, std) values (drawing 0.6 B normals would take
    longer than the runs on a loaded 2-core machine; what a tower costs does not depend on its values), norms' scales
    1, biases 0."""
    pool = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * std
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if parameter.ndim == 1:
                parameter.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
                continue
            flat = parameter.view(-1)
            for start in range(0, flat.numel(), pool.numel()):
                piece = flat[start:start + pool.numel()]
                piece.copy_(pool[:piece.numel()])


def video_inputs(tower, frames: int, height: int, width: int, dtype: torch.dtype, seed: int = 0):
    """Random ``pixel_values`` ``(t * h * w, channels * 2 * patch^2)`` and ``grid_thw`` ``[[t, h, w]]`` for one
    video of ``frames`` frames of ``height x width`` px."""
    config = tower.config
    patch, frames_per_tubelet = config.patch_size, config.temporal_patch_size
    if height % (2 * patch) or width % (2 * patch) or frames % frames_per_tubelet:
        raise ValueError(f"--height/--width must be multiples of {2 * patch} px and frames of {frames_per_tubelet}; "
                         f"got {height}x{width}, {frames} frames.")
    t, h, w = frames // frames_per_tubelet, height // patch, width // patch
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(t * h * w, 3 * frames_per_tubelet * patch * patch, generator=generator).to(dtype)
    return pixels, torch.tensor([[t, h, w]])


def evs_prune(features: torch.Tensor, slices: int, keep: int) -> torch.Tensor:
    """Post-encoder pruning as vLLM's EVS does it: ``features (slices * units, D)`` of one video (stock order) ->
    the ``keep`` rows most unlike the row at the same place in the previous tubelet, the first tubelet always kept,
    in their original order."""
    rows = features.view(slices, -1, features.shape[-1]).float()
    dissimilarity = 1 - torch.nn.functional.cosine_similarity(rows[1:], rows[:-1], dim=-1)
    scores = torch.cat([torch.full_like(rows[0, :, 0], float("inf")).unsqueeze(0), dissimilarity]).flatten()
    kept = scores.topk(keep).indices.sort().values
    return features[kept]


def plan_for(depth: int, slices: int, units: int, keep: float, merge_blocks: int | None = None
             ) -> dict[str, list[int]]:
    """`plan_kept_fraction` with the split between time and space (``temporal_share`` 0.5, else 1 or 0) that keeps
    the count closest to ``keep`` (with few units per tubelet the even split can fall well short of it), its merges
    spread over the first ``merge_blocks`` blocks (None: all of them)."""
    plans = []
    for share in (0.5, 1.0, 0.0):
        try:
            plans.append(plan_kept_fraction(depth, slices, units, keep, temporal_share=share,
                                            merge_blocks=merge_blocks))
        except ValueError:  # this split cannot reach the budget within TESTA's caps
            pass

    def kept(plan):
        t, u = token_grid(video_settings(depth, **plan), slices, units)
        return t * u

    return max(plans, key=kept)  # every plan keeps at most `keep`; the first of the largest


def memory_kib() -> dict[str, int]:
    values = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            name, amount = line.split(":")
            values[name] = int(amount.split()[0])
    return values


def reset_peak() -> bool:
    """Resets this process's VmHWM to its VmRSS (Linux ``clear_refs`` 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def measure(spec: dict) -> dict:
    """One configuration (``spec``: family, mode, frames, quick, height, width, chunk_frames, dtype): tower time,
    token counts, outputs' bytes and the activation peak."""
    torch.set_grad_enabled(False)
    dtype = getattr(torch, spec["dtype"])
    family, mode, frames = spec["family"], spec["mode"], spec["frames"]
    tower = build_tower(family, spec["quick"], dtype)
    adapter = Qwen2_5_VLAdapter() if family == "qwen2_5_vl" else Qwen3VLAdapter()
    base = SimpleNamespace(visual=tower)
    pixels, grid = video_inputs(tower, frames, spec["height"], spec["width"], dtype)
    slices, units = int(grid[0, 0]), int(grid[0, 1] * grid[0, 2]) // 4
    depth = len(tower.blocks)
    kind = mode.removesuffix("-chunk")
    chunk = spec["chunk_frames"] if mode.endswith("-chunk") else None
    keep = KEEP.get(kind)
    schedule = plan_for(depth, slices, units, keep, spec.get("merge_blocks")) if keep else {}
    settings = video_settings(depth, schedule.get("temporal_reduction", 0), schedule.get("spatial_reduction", 0))
    kept_slices, kept_units = token_grid(settings, slices, units)

    def run(pixel_values, grid_thw):
        if kind == "stock":
            output = tower(pixel_values, grid_thw=grid_thw)
            features = [output.pooler_output] + list(getattr(output, "deepstack_features", None) or [])
            return features
        video = adapter.encode(base, pixel_values, grid_thw, settings, chunk,
                               spec.get("chunk_offload") if chunk else None)[0]
        return [video.features] + list(video.deepstack)

    warm_pixels, warm_grid = video_inputs(tower, 2, spec["height"], spec["width"], dtype, seed=1)
    run(warm_pixels, warm_grid)
    weights = sum(p.numel() * p.element_size() for p in tower.parameters())
    before = memory_kib()["VmRSS"]
    peak_reset = reset_peak()
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = run(pixels, grid)
    tower_s, tower_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    peak = memory_kib()["VmHWM"]
    repeat_s = []
    for _ in range(spec.get("repeats", 1) - 1):  # (after the peak: memory is that of the first run)
        start = time.perf_counter()
        run(pixels, grid)
        repeat_s.append(time.perf_counter() - start)
    prune_s = pruned_tokens = None
    llm_tokens = outputs[0].shape[0]
    if kind == "stock":  # post-encoder pruning to TESTA's 25% count, after the same stock tower
        prune_grid = token_grid(video_settings(depth, **plan_for(depth, slices, units, 0.25, spec.get("merge_blocks"))),
                                slices, units)
        start = time.perf_counter()
        pruned = evs_prune(outputs[0], slices, prune_grid[0] * prune_grid[1])
        prune_s = time.perf_counter() - start
        pruned_tokens = pruned.shape[0]
    return {
        **spec, "tubelets": slices, "units_per_tubelet": units, "tower_tokens_in": slices * units * 4,
        "llm_video_tokens": llm_tokens, "stock_llm_video_tokens": slices * units, "tower_s": tower_s,
        "tower_cpu_s": tower_cpu_s, **({"repeat_tower_s": min(repeat_s)} if repeat_s else {}),
        "prune_s": prune_s, "pruned_llm_video_tokens": pruned_tokens, "weights_mib": weights / 2**20, "rss_before_mib": before / 1024,
        "activation_peak_mib": (peak - before) / 1024 if peak_reset else None,
        "outputs_mib": sum(o.numel() * o.element_size() for o in outputs) / 2**20,
        "schedule": schedule,
    }


def child(spec: dict) -> dict:
    """``measure(spec)`` in a fresh Python process (its own peak)."""
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "benchmarks.video_llm_towers", "--child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, env=environment,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode:
        raise RuntimeError(f"{spec}: the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plan(args) -> list[dict]:
    """The configurations to measure, in order."""
    specs = []
    common = {"quick": args.quick, "height": args.height, "width": args.width, "chunk_frames": args.chunk_frames,
              "dtype": args.dtype, "merge_blocks": args.merge_blocks, "chunk_offload": args.chunk_offload,
              "repeats": args.repeats}
    for family in args.families:
        for frames in [] if args.memory_only else args.frames:
            for mode in args.modes:
                specs.append({**common, "family": family, "mode": mode, "frames": frames})
        if args.skip_long:
            continue
        small, large = args.chunk_frames, args.long_frames
        long_rows = ((small, "stock"), (small, "testa25"), (large, "stock"), (large, "idle-chunk"),
                     (large, "testa25-chunk"))
        if args.memory_only:  # the chunked targets' rows: the references at one chunk, the chunked long video
            long_rows = tuple(row for row in long_rows if row != (large, "stock"))
        for frames, mode in long_rows:
            spec = {**common, "family": family, "mode": mode, "frames": frames}
            if spec not in specs:
                specs.append(spec)
    return specs


def summary(rows: list[dict], args) -> dict:
    """The ratios of the targets, per family, from the rows of one run."""
    out = {}
    for family in args.families:
        def row(mode, frames):
            return next((r for r in rows if r["family"] == family and r["mode"] == mode and r["frames"] == frames),
                        None)
        small, large = args.chunk_frames, args.long_frames
        ratios = {}
        for frames in args.frames:
            stock = row("stock", frames)
            if stock is None:  # (a merged partial run: what was not measured has no ratio)
                continue
            for mode in ("testa50", "testa25"):
                if row(mode, frames) is None:
                    continue
                ratios[f"{mode}_time_over_stock@{frames}"] = row(mode, frames)["tower_s"] / stock["tower_s"]
                if "repeat_tower_s" in stock and "repeat_tower_s" in row(mode, frames):  # shapes met before
                    ratios[f"{mode}_repeat_time_over_stock@{frames}"] = (row(mode, frames)["repeat_tower_s"]
                                                                         / stock["repeat_tower_s"])
                if "tower_cpu_s" in stock and "tower_cpu_s" in row(mode, frames):  # CPU seconds: less disturbed
                    ratios[f"{mode}_cpu_time_over_stock@{frames}"] = (row(mode, frames)["tower_cpu_s"]
                                                                      / stock["tower_cpu_s"])
                ratios[f"{mode}_llm_tokens_over_stock@{frames}"] = (row(mode, frames)["llm_video_tokens"]
                                                                    / stock["llm_video_tokens"])
            ratios[f"prune25_time_over_stock@{frames}"] = (stock["tower_s"] + stock["prune_s"]) / stock["tower_s"]
        stock_small, stock_large = row("stock", small), row("stock", large)
        # (in process, a tiny tower's peak can read 0: its memory was already the process's; no ratio then)
        if stock_small and stock_large and stock_small["activation_peak_mib"]:
            ratios[f"stock_peak_growth_{small}_to_{large}"] = (stock_large["activation_peak_mib"]
                                                              / stock_small["activation_peak_mib"])
        for chunked, reference in (("idle-chunk", "stock"), ("testa25-chunk", "testa25"), ("testa25-chunk", "stock")):
            c, r = row(chunked, large), row(reference, small)
            if c is None or r is None or r["activation_peak_mib"] is None:
                continue
            ratios[f"{chunked}@{large}_peak_over_{reference}@{small}_peak_plus_outputs"] = (
                c["activation_peak_mib"] / (r["activation_peak_mib"] + c["outputs_mib"]))
        out[family] = ratios
    return out


def table(rows: list[dict]) -> str:
    lines = ["| tower | frames | config | tower tokens in | LLM video tokens | tower s (wall) | tower CPU s | prune s "
             "| activation peak MiB | outputs MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    shown = []
    for r in rows:
        shown.append(r)
        if r["mode"] == "stock":  # the engines' way: the stock tower, then pruning (its time beside)
            shown.append({**r, "mode": "stock + prune to testa25's count", "llm_video_tokens": r["pruned_llm_video_tokens"],
                          "activation_peak_mib": None})
    for r in shown:
        name = FAMILIES[r["family"]][0] + (" (tiny)" if r["quick"] else "")
        peak = "n/a" if r["activation_peak_mib"] is None else f"{r['activation_peak_mib']:.1f}"
        prune = f"{r['prune_s']:.4f}" if r["mode"].startswith("stock +") else ""
        cpu = f"{r['tower_cpu_s']:.2f}" if "tower_cpu_s" in r else "n/a"
        offload = r.get("chunk_offload") if r["mode"].endswith("-chunk") else None
        config = r["mode"] + (f" ({offload} offload)" if offload else "")
        lines.append(f"| {name} | {r['frames']} | {config} | {r['tower_tokens_in']} | {r['llm_video_tokens']} "
                     f"| {r['tower_s']:.2f} | {cpu} | {prune} | {peak} | {r['outputs_mib']:.1f} |")
    return "\n".join(lines)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny towers, few frames (seconds)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--frames", type=int, nargs="+", default=None, help="default 32 64 128 (--quick: 8 16)")
    parser.add_argument("--long-frames", type=int, default=None, help="the long video (default 256, --quick 32)")
    parser.add_argument("--chunk-frames", type=int, default=None, help="frames per chunk (default 32, --quick 8)")
    parser.add_argument("--height", type=int, default=None, help="px (default 112 / Qwen3-VL 128: 4 merge units; --quick 28 / 32)")
    parser.add_argument("--width", type=int, default=None, help="px (default 112 / Qwen3-VL 128: 4 merge units; --quick 56 / 64)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--in-process", action="store_true",
                        help="measure in this process (no fresh child per configuration: peaks not comparable)")
    parser.add_argument("--json", help="write rows, ratios and the run's facts here")
    parser.add_argument("--modes", nargs="+", default=["stock", "testa50", "testa25"],
                        choices=["stock", "testa50", "testa25"], help="what to time at --frames")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each configuration's video (default 1); with more, the fastest of the later "
                             "runs is reported too (repeat_tower_s) and its ratio to stock's")
    parser.add_argument("--merge-blocks", type=int, default=None,
                        help="TESTA's merges in the first N blocks only (default: spread over every block); earlier "
                             "merges leave fewer tokens to the later blocks, so less tower time for the same count")
    parser.add_argument("--chunk-offload", choices=["cpu", "disk"], default=None,
                        help="the chunked runs hold the whole video at a temporal merge in host memory or on disk "
                             "(the adapter option chunk_offload; default: where the tower runs)")
    parser.add_argument("--skip-long", action="store_true", help="no runs at --long-frames (memory)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the chunked-memory rows: stock and testa25 at --chunk-frames, idle-chunk and "
                             "testa25-chunk at --long-frames (no --frames rows, no stock run at --long-frames)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no run: the rows of these earlier --json files (or their .partial rows) together, with "
                             "their ratios (e.g. the two towers measured by two runs at the same time)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.frames = args.frames or ([8, 16] if args.quick else [32, 64, 128])
    args.long_frames = args.long_frames or (32 if args.quick else 256)
    args.chunk_frames = args.chunk_frames or (8 if args.quick else 32)
    args.dtype = args.dtype or ("bfloat16" if native_bf16() else "float32")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return {}
    if args.merge:
        rows, facts = [], {}
        for path in args.merge:
            with open(path) as handle:
                loaded = json.load(handle)
            rows += loaded["rows"] if isinstance(loaded, dict) else loaded
            if isinstance(loaded, dict):
                facts.setdefault("runs", []).append({k: v for k, v in loaded.items() if k not in ("rows", "ratios")})
        args.families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
        result = {**facts, "rows": rows, "ratios": summary(rows, args)}
        print(table(rows))
        print(json.dumps(result["ratios"], indent=1))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(result, handle, indent=1)
        return result
    rows, load_start = [], os.getloadavg()
    for spec in plan(args):
        # Qwen3-VL's patches are 16 px, Qwen2.5-VL's 14: the same 4 x 4 merge units per frame by default
        patch = 16 if spec["family"] == "qwen3_vl" else 14
        spec["height"] = spec["height"] or (2 if args.quick else 8) * patch
        spec["width"] = spec["width"] or (4 if args.quick else 8) * patch
        rows.append(measure(spec) if args.in_process else child(spec))
        print(f"{rows[-1]['family']} {rows[-1]['mode']} {rows[-1]['frames']} frames: {rows[-1]['tower_s']:.2f} s, "
              f"peak {rows[-1]['activation_peak_mib']} MiB", file=sys.stderr, flush=True)
        if args.json:  # the rows so far, should a long run be stopped
            with open(args.json + ".partial", "w") as handle:
                json.dump(rows, handle, indent=1)
    result = {
        "command": "python -m benchmarks.video_llm_towers " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": cpu_name(), "native_bf16": native_bf16(), "torch_threads": torch.get_num_threads(),
        "load_average_start_end": [load_start, os.getloadavg()], "rows": rows, "ratios": summary(rows, args),
    }
    print(table(rows))
    print(json.dumps(result["ratios"], indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
        if os.path.exists(args.json + ".partial"):
            os.remove(args.json + ".partial")
    return result


if __name__ == "__main__":
    main()
