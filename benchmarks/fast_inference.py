"""Fast CPU inference (`optimize_for_inference`): speed against transformers' TimesformerModel and our unmerged
encoder, batch throughput, and the quality contract on a trained model.

    python -m benchmarks.fast_inference                        # speed rows: ViT-B/16, 32 frames, 224 px, batch 1
    python -m benchmarks.fast_inference --batches 1 4 8        # + videos/s at batch 1, 4 and 8 (fastest variants)
    python -m benchmarks.fast_inference --compile              # + a merged fp32 + torch.compile row (slow to compile)
    python -m benchmarks.fast_inference --small                # a quick look (8 frames, 112 px, 6 layers)
    python -m benchmarks.fast_inference --no-speed --model outputs/demo/runs/b/final --data outputs/demo/data
        --config configuration/short_events.yaml               # the quality contract only (after `make demo`)

**Speed** (random weights, one process, inference mode): the contenders are run in turn, ``--repeats`` times, and
medians are reported with their ratios, so every ratio comes from one run (as in `encoder_speed.py`). The merged
variants are copies of one model (the paper's 32-frame setting R_T=1, R_S=12), so their pooled embeddings are
compared with the merged fp32 one: the cosine of the CLS token and of the mean over all output tokens (what the
retrieval head pools by default), per video.

**Exported encoders** (``--backends openvino onnxruntime``, those installed): the TESTA encoder exported with its
merging (`testa_runtimes/exported.py`) in every precision the backend offers on this CPU; their first forward exports
(or loads ``--cache-dir``). Next to TimesformerModel as transformers runs it (eager attention) stands the same model
with its attention computed by `F.scaled_dot_product_attention`, so the share of any ratio that SDPA alone gives shows.
The merged variants trace their merge decisions (``trace_source``) and the table gives the share of videos whose
decisions equal merged fp32's, and the cosine contract (fp32 exports: >= 0.99999; bf16 0.995; int8 0.98).

**Batch throughput** (``--batches``): videos/s of the merged fp32 and int8 encoders (``--throughput-variants``) at
each batch size, alternating the variants.

**Quality contract** (``--model DIR --data DIR``): the test split of a trained retrieval model (e.g. the demo's,
`train/demo.py`) is ranked with `train/evaluation.py`'s `evaluate_retrieval`, as the demo does, once per precision,
with fp32 as the reference: t2v R@1 and R@5 must stay within 1 point, and every video's embedding must keep a cosine
of at least 0.995 (bf16) and 0.98 (int8) with its fp32 embedding. Each item is printed with pass/fail. fp32's own
noise floor is measured too: fp64, and fp32 on pixels scaled by 1 + k * 1e-6 (``--noise-draws`` runs); the recall of
fp32 and its perturbed runs spans fp32's noise band, and a second recall verdict asks whether a precision stays within
that band (+- 1 point), i.e. moves recall no more than fp32's own rounding does.
"""

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from modeling_testa import TestaVisionConfig, TestaVisionModel
from testa_runtimes import optimize_for_inference
from benchmarks.encoder_args import add_encoder_arguments, encoder_settings


LABELS = {
    "timesformer": "transformers TimesformerModel, fp32 (eager attention)",
    "timesformer-sdpa": "transformers TimesformerModel, fp32, attention by SDPA",
    "testa-none": "TESTA unmerged, fp32",
    "testa": "TESTA merged, fp32",
    "testa-compile": "TESTA merged, fp32 + torch.compile",
    "testa-bf16": "TESTA merged, bf16",
    "testa-int8": "TESTA merged, int8 (torch, legacy)",
    "openvino-fp32": "TESTA merged, OpenVINO fp32",
    "openvino-bf16": "TESTA merged, OpenVINO bf16",
    "openvino-int8": "TESTA merged, OpenVINO int8 (NNCF)",
    "onnxruntime-fp32": "TESTA merged, ONNX Runtime fp32",
    "onnxruntime-int8": "TESTA merged, ONNX Runtime int8 (static QDQ)",
}
PRECISION_OF = {"testa": "fp32", "testa-compile": "fp32", "testa-bf16": "bf16", "testa-int8": "int8",
                "openvino-fp32": "fp32", "openvino-bf16": "bf16", "openvino-int8": "int8",
                "onnxruntime-fp32": "fp32", "onnxruntime-int8": "int8"}
ENGINE_VARIANTS = ("openvino-fp32", "openvino-bf16", "openvino-int8", "onnxruntime-fp32", "onnxruntime-int8")
CONTRACT = {"bf16": 0.995, "int8": 0.98}
"""Minimum per-video embedding cosine with fp32."""
CLOCKS = {
    "wall": "wall-clock time",
    "cpu": "this process's CPU time (with --threads 1: the time on one core, robust to other load on the machine)",
}
RECALL_TOLERANCE = 1.0
"""t2v R@1 and R@5 must stay within this many points of fp32."""


def code_version() -> dict[str, str]:
    """The commit measured (with "+changes" when the work tree differs from it) and the date, for the table's caption."""
    def git(*arguments: str) -> str:
        try:
            done = subprocess.run(["git", *arguments], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                                  text=True)
        except OSError:  # no git on this machine (a copied tree)
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def cpu_description() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    model = platform.processor() or platform.machine()
    try:
        model = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                     if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
    present = [f for f in wanted if f in flags] or ["(flags unknown)"]
    load = "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    return (f"{model}; {os.cpu_count()} cores, {torch.get_num_threads()} threads; torch {torch.__version__}, "
            f"capability {torch.backends.cpu.get_cpu_capability()}; flags: {' '.join(present)}; {load}")


def sdpa_attention(module, hidden_states, output_attentions: bool = False):
    """transformers' `TimesformerSelfAttention.forward` with the attention computed by
    `F.scaled_dot_product_attention` (the same scale, no dropout at inference)."""
    batch, tokens, channels = hidden_states.shape
    qkv = module.qkv(hidden_states).reshape(batch, tokens, 3, module.num_heads, channels // module.num_heads)
    query, key, value = qkv.permute(2, 0, 3, 1, 4)
    context = F.scaled_dot_product_attention(query, key, value, scale=module.scale)
    return (context.transpose(1, 2).reshape(batch, tokens, channels),)


def available_engines() -> list[str]:
    """The exported variants this machine can run: the backends installed, bf16 only where the CPU has it."""
    from testa_runtimes.exported import cpu_has_bf16
    from testa_runtimes.registry import RUNTIMES

    found = []
    for variant in ENGINE_VARIANTS:
        backend, precision = variant.split("-")
        try:
            RUNTIMES[backend].require_packages()
        except ImportError as error:
            print(f"skipping {variant}: {error}")
            continue
        if precision == "bf16" and not cpu_has_bf16():
            print(f"skipping {variant}: this CPU has no bf16 instructions")
            continue
        found.append(variant)
    return found


def build(variant: str, args, base: TestaVisionModel | None = None) -> torch.nn.Module:
    common = encoder_settings(args)
    if variant in ("timesformer", "timesformer-sdpa"):
        import types

        from transformers import TimesformerConfig, TimesformerModel
        from transformers.models.timesformer.modeling_timesformer import TimesformerSelfAttention

        config = TimesformerConfig(**common, attention_type="divided_space_time", qkv_bias=True)
        model = TimesformerModel(config).eval()
        if variant == "timesformer-sdpa":
            for module in model.modules():
                if isinstance(module, TimesformerSelfAttention):
                    module.forward = types.MethodType(sdpa_attention, module)
        return model
    if variant == "testa-none":
        return TestaVisionModel(TestaVisionConfig(**common, temporal_reduction=0, spatial_reduction=0)).eval()
    if base is None:  # the merged variants trace their merge decisions, to compare them with merged fp32
        config = TestaVisionConfig(**common, temporal_reduction=args.temporal_reduction,
                                   spatial_reduction=args.spatial_reduction, trace_source=True)
        return TestaVisionModel(config).eval()
    if variant in ENGINE_VARIANTS:
        backend, precision = variant.split("-")
        # int8 is calibrated on videos of the inputs' distribution (white noise, as the timed input), not the input
        calibration = None  # 0 videos: the library's default
        if precision == "int8" and args.calibration_videos:
            generator = torch.Generator().manual_seed(1234)
            calibration = torch.randn(args.calibration_videos, args.frames, 3, args.image_size, args.image_size,
                                      generator=generator)
        return optimize_for_inference(copy.deepcopy(base), precision, backend=backend, cache_dir=args.cache_dir,
                                      calibration=calibration)
    return optimize_for_inference(copy.deepcopy(base), PRECISION_OF[variant], compile=variant == "testa-compile")


def forward(model, video) -> tuple[dict, tuple | None]:
    """`{"wall": s, "cpu": s}` of one forward pass (wall clock, and this process's CPU time; the engines' threads
    are threads of this process), and, for a TESTA model, its CLS and mean-pooled output and its source map."""
    start, start_cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model(pixel_values=video)
    seconds = {"wall": time.perf_counter() - start, "cpu": time.process_time() - start_cpu}
    if isinstance(model, TestaVisionModel):
        return seconds, (out.pooler_output.float(), out.last_hidden_state.float().mean(dim=1), out.source_map)
    return seconds, None


def unmerged_ratio(ratio_of: dict, variant: str) -> str:
    """The speed-up over our unmerged encoder, or "-" when that row was skipped."""
    return f"{ratio_of['testa-none'] / ratio_of[variant]:.2f}x" if "testa-none" in ratio_of else "-"


def speed_variants(args) -> list[str]:
    variants = ["timesformer", "timesformer-sdpa", "testa-none", "testa"] + \
        (["testa-compile"] if args.compile else []) + ["testa-bf16", "testa-int8"]
    variants += [v for v in available_engines() if v.split("-")[0] in args.backends]
    return [v for v in variants if v not in args.skip or v in ("timesformer", "timesformer-sdpa", "testa")]


def speed(args) -> dict:
    torch.manual_seed(0)
    variants = speed_variants(args)
    base = build("testa", args)
    models = {v: base if v == "testa" else build(v, args, base) for v in variants}
    video = torch.randn(args.batch, args.frames, 3, args.image_size, args.image_size)

    first, outputs = {}, {}
    for v in variants:  # warm-up; the compiled variant compiles here, the engines export (or load their cache)
        first[v], outputs[v] = forward(models[v], video)
        print(f"warm-up {LABELS[v]}: {first[v]['wall']:.2f} s", flush=True)
    times = {clock: defaultdict(list) for clock in ("wall", "cpu")}
    for repeat in range(args.repeats):
        for v in variants:
            seconds = forward(models[v], video)[0]
            for clock in times:
                times[clock][v].append(seconds[clock])
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{v} {times['wall'][v][-1]:.2f} s (CPU {times['cpu'][v][-1]:.2f} s)" for v in variants), flush=True)
    median = {clock: {v: statistics.median(t) for v, t in per.items()} for clock, per in times.items()}
    ratio_of = median[args.clock]

    print(f"\n{args.frames} frames, {args.image_size} px, hidden {args.hidden_size}, {args.layers} layers, batch "
          f"{args.batch}, R_T={args.temporal_reduction}, R_S={args.spatial_reduction}; median of {args.repeats}, "
          f"contenders alternating; speed-ups from {CLOCKS[args.clock]}\n{cpu_description()}\n")
    print("| encoder | wall time (s) | CPU time (s) | videos/s (wall) | speed-up vs TimesformerModel eager | "
          "speed-up vs TimesformerModel SDPA | speed-up vs ours unmerged | cosine CLS vs merged fp32 (min over videos) "
          "| cosine mean-pooled vs merged fp32 (min) | videos with merged fp32's merge decisions | quality contract |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cosines = {}
    for v in variants:
        if v in PRECISION_OF:
            cls, mean, source_map = outputs[v]
            ref_cls, ref_mean, ref_map = outputs["testa"]
            same = float((source_map == ref_map).flatten(1).all(dim=1).float().mean())
            cosines[v] = (float(F.cosine_similarity(cls, ref_cls).min()), float(F.cosine_similarity(mean, ref_mean).min()),
                          same)
            threshold = CONTRACT.get(PRECISION_OF[v], 0.99999)  # an fp32 export must equal PyTorch fp32
            verdict = f"{'PASS' if min(cosines[v][:2]) >= threshold else 'FAIL'} (min >= {threshold})"
            cos = f"{cosines[v][0]:.5f} | {cosines[v][1]:.5f} | {100 * same:.0f}% | {verdict}"
        else:
            cos = "- | - | - | -"
        print(f"| {LABELS[v]} | {median['wall'][v]:.3f} | {median['cpu'][v]:.3f} | {args.batch / median['wall'][v]:.3f} | "
              f"{ratio_of['timesformer'] / ratio_of[v]:.2f}x | {ratio_of['timesformer-sdpa'] / ratio_of[v]:.2f}x | "
              f"{unmerged_ratio(ratio_of, v)} | {cos} |")
    exported = [v for v in variants if v in ENGINE_VARIANTS]
    if exported:
        print("\nFirst forward of the exported variants (export, quantization and compilation, or loading the cache): " +
              ", ".join(f"{v} {first[v]['wall']:.0f} s" for v in exported))
    if "testa-compile" in first:
        print(f"\ntorch.compile: the first forward (compilation) took {first['testa-compile']['wall']:.0f} s.")
    if "testa-none" in ratio_of:
        ratio = ratio_of["testa-none"] / ratio_of["testa"]
        print(f"\nmerged fp32 vs our unmerged fp32: {ratio:.2f}x (target >= 1.8x): {'PASS' if ratio >= 1.8 else 'FAIL'}")
    return {"median_s": median, "times_s": {c: dict(t) for c, t in times.items()}, "first_forward_s": first,
            "cosine_cls_mean": cosines, "clock": args.clock}


def throughput(args) -> dict:
    torch.manual_seed(0)
    base = build("testa", args)
    variants = args.throughput_variants
    models = {v: base if v == "testa" else build(v, args, base) for v in variants}
    ratios = {}
    result = {}
    print(f"\nvideos/s from {CLOCKS[args.clock]}, median of {args.throughput_repeats}, variants alternating\n")
    print("| batch | " + " | ".join(f"{LABELS[v]}: videos/s" for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for batch in args.batches:
        video = torch.randn(batch, args.frames, 3, args.image_size, args.image_size)
        for v in variants:
            forward(models[v], video)  # warm-up at this shape
        times = defaultdict(list)
        for _ in range(args.throughput_repeats):
            for v in variants:
                times[v].append(forward(models[v], video)[0][args.clock])
        rates = {v: batch / statistics.median(times[v]) for v in variants}
        result[batch] = rates
        print(f"| {batch} | " + " | ".join(f"{rates[v]:.3f}" for v in variants) + " |", flush=True)
        if "timesformer" in rates:
            ratios[batch] = {v: rates[v] / rates["timesformer"] for v in variants}
    for batch, per in ratios.items():
        print(f"batch {batch}, videos/s relative to TimesformerModel eager: " +
              ", ".join(f"{v} {r:.2f}x" for v, r in per.items()))
    print(cpu_description())
    return result


def perturb_pixels(factor: float):
    def hook(module, args, kwargs):
        if args:
            return (args[0] * factor, *args[1:]), kwargs
        return args, {**kwargs, "pixel_values": kwargs["pixel_values"] * factor}

    return hook


def calibration_videos(args, processor) -> torch.Tensor | None:
    """The first ``--calibration-videos`` videos of the dataset's train split, decoded as the model sees them: the
    engines' int8 is calibrated on them (never on the test videos it is evaluated on). 0: None, the library's default
    (`exported.default_calibration_videos`, what a caller gets without ``calibration=``)."""
    from processing.data import load_split

    if args.calibration_videos == 0:
        return None

    rows = load_split(str(args.data), "train")
    paths = [rows[i]["video"] for i in range(min(args.calibration_videos, len(rows)))]
    return processor.video_processor(videos=paths, return_tensors="pt")["pixel_values"]


def quality(args) -> dict:
    import yaml
    from accelerate import Accelerator

    from modeling_testa import TestaForVideoTextRetrieval, TestaProcessor
    from testa_search.store.video_store import VideoTokenStore
    from train.evaluation import evaluate_retrieval

    recipe = yaml.safe_load(args.config.read_text())
    recipe["data"]["dataset"] = str(args.data)
    processor = TestaProcessor.from_pretrained(str(args.model))
    recipe["data"]["num_frames"] = processor.video_processor.num_frames  # the model's frames, not the recipe's
    accelerator = Accelerator(cpu=True)
    engines = [v.replace("-", " ") for v in available_engines() if v.split("-")[0] in args.backends]
    rows = ["fp32", "bf16", "int8"] + (["int8 + text"] if args.text else []) + engines
    noise_rows = [] if args.no_noise_floor else [f"fp32, pixels x (1 + {k}e-6)" for k in range(1, args.noise_draws + 1)]
    rows += (["fp64"] if not args.no_noise_floor else []) + noise_rows
    results, embeddings, source_maps = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="testa-fast-quality-") as tmp:
        for i, name in enumerate(rows):
            model = TestaForVideoTextRetrieval.from_pretrained(str(args.model))
            model.set_aggregation(trace_source=True)  # to compare the merge decisions with fp32
            if name in engines:
                backend, precision = name.split()
                calibration = calibration_videos(args, processor) if precision == "int8" else None
                optimize_for_inference(model, precision, backend=backend, cache_dir=args.cache_dir,
                                       calibration=calibration)
            elif name in ("bf16", "int8", "int8 + text"):
                optimize_for_inference(model, name.split()[0], include_text=name.endswith("text"))
            elif name == "fp64":
                model.double()
            elif name in noise_rows:
                k = noise_rows.index(name) + 1
                model.vision_model.register_forward_pre_hook(perturb_pixels(1 + k * 1e-6), with_kwargs=True)
            maps = []
            model.vision_model.register_forward_hook(lambda module, inputs, out: maps.append(out.source_map))
            store_dir = Path(tmp) / f"store{i}"
            metrics = evaluate_retrieval(model, processor, recipe, accelerator, store_dir=store_dir)
            store = VideoTokenStore(store_dir)
            embeddings[name] = F.normalize(store.embeddings.float(), dim=-1)
            store.close()
            results[name], source_maps[name] = metrics, torch.cat(maps)
            print(f"{name}: t2v R@1 {metrics['t2v_R@1']:.2f}, R@5 {metrics['t2v_R@5']:.2f}", flush=True)
    reference = results["fp32"]
    # fp32's noise band: the recall of fp32 itself and of fp32 on pixels scaled by 1 + k * 1e-6. Where merge
    # decisions are nearly tied, such noise already moves recall; a precision inside the band (+- the tolerance)
    # changes recall no more than fp32's own rounding does.
    band = None if not noise_rows else {
        metric: (min(results[r][metric] for r in ["fp32", *noise_rows]),
                 max(results[r][metric] for r in ["fp32", *noise_rows])) for metric in ("t2v_R@1", "t2v_R@5")}
    floor = "" if args.no_noise_floor else "; the last rows are fp32's own noise floor, not contenders"
    print(f"\nQuality contract on {args.model} ({reference['num_videos']} test videos, {reference['num_texts']} "
          f"texts; fp32 is the reference{floor})\n")
    if noise_rows:
        print(f"fp32 noise band over fp32 and its {len(noise_rows)} perturbed runs: t2v R@1 "
              f"{band['t2v_R@1'][0]:.2f}-{band['t2v_R@1'][1]:.2f}, R@5 {band['t2v_R@5'][0]:.2f}-"
              f"{band['t2v_R@5'][1]:.2f}\n")
    print("| precision | t2v R@1 | t2v R@5 | ΔR@1 | ΔR@5 | embedding cosine vs fp32: min | mean | videos with "
          "fp32's merge decisions | min cosine over those | R@1/R@5 within 1 point | R@1/R@5 within fp32's noise "
          "band +- 1 | cosine contract |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    verdicts = {}
    for name, m in results.items():
        d1, d5 = m["t2v_R@1"] - reference["t2v_R@1"], m["t2v_R@5"] - reference["t2v_R@5"]
        cos = (embeddings[name] * embeddings["fp32"]).sum(dim=-1)
        same = (source_maps[name] == source_maps["fp32"]).flatten(1).all(dim=1)
        valid = embeddings["fp32"].norm(dim=-1) > 0  # a video that could not be decoded has no embedding
        cos = cos[valid]  # (source maps exist for the encoded videos only, in order)
        recall_ok = abs(d1) <= RECALL_TOLERANCE and abs(d5) <= RECALL_TOLERANCE
        in_band = None if band is None else all(
            band[k][0] - RECALL_TOLERANCE <= m[k] <= band[k][1] + RECALL_TOLERANCE for k in band)
        threshold = CONTRACT.get(name.split()[0]) if name in ("bf16", "int8", "int8 + text") else None
        if name in engines:  # an fp32 export must equal PyTorch fp32
            threshold = CONTRACT.get(name.split()[1], 0.99999)
        cos_ok = threshold is None or float(cos.min()) >= threshold
        same_cos = f"{float(cos[same].min()):.5f}" if bool(same.any()) else "-"
        verdicts[name] = {"recall": recall_ok, "cosine": cos_ok, "min_cosine": float(cos.min()),
                          "mean_cosine": float(cos.mean()), "same_decisions": float(same.float().mean()),
                          "delta_R@1": d1, "delta_R@5": d5, "within_noise_band": in_band}
        contract = "-" if threshold is None else f"{'PASS' if cos_ok else 'FAIL'} (min >= {threshold})"
        print(f"| {name} | {m['t2v_R@1']:.2f} | {m['t2v_R@5']:.2f} | {d1:+.2f} | {d5:+.2f} | {float(cos.min()):.5f} | "
              f"{float(cos.mean()):.5f} | {100 * float(same.float().mean()):.1f}% | {same_cos} | "
              f"{'PASS' if recall_ok else 'FAIL'} | {'-' if in_band is None else 'PASS' if in_band else 'FAIL'} | {contract} |")
    return {"metrics": {k: {m: v for m, v in r.items() if not isinstance(v, list)} for k, r in results.items()},
            "verdicts": verdicts, "noise_band": band}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_encoder_arguments(parser, frames=32, temporal_reduction=1, spatial_reduction=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="add merged fp32 + torch.compile (compiles for minutes)")
    parser.add_argument("--small", action="store_true", help="8 frames, 112 px, 6 layers: a quick look")
    parser.add_argument("--no-speed", action="store_true", help="skip the batch-1 speed rows")
    parser.add_argument("--batches", type=int, nargs="*", default=[], help="batch sizes for videos/s, e.g. 1 4 8")
    parser.add_argument("--throughput-variants", nargs="+", default=["testa", "testa-int8"],
                        choices=["timesformer", "timesformer-sdpa", "testa", "testa-compile", "testa-bf16",
                                 "testa-int8", *ENGINE_VARIANTS])
    parser.add_argument("--backends", nargs="*", default=["openvino", "onnxruntime"],
                        choices=["openvino", "onnxruntime"], help="exported rows to add (those installed)")
    parser.add_argument("--skip", nargs="*", default=[], choices=sorted(set(LABELS) - {"timesformer",
                        "timesformer-sdpa", "testa"}), help="speed rows to leave out (the baselines always run)")
    parser.add_argument("--calibration-videos", type=int, default=4,
                        help="videos that calibrate the engines' int8: random ones in the speed rows, the train split's "
                             "first ones in the quality rows, where 0 means the library's default (default: 4)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the exported encoders are cached (default: $HF_HOME/testa/engines)")
    parser.add_argument("--throughput-repeats", type=int, default=2)
    parser.add_argument("--model", type=Path, help="a trained TestaForVideoTextRetrieval folder (quality contract)")
    parser.add_argument("--data", type=Path, help="its dataset folder (test.jsonl and the videos)")
    parser.add_argument("--config", type=Path, default=Path(__file__).resolve().parents[1] / "configuration" /
                        "synthetic_retrieval.yaml", help="the recipe whose data/eval settings are used")
    parser.add_argument("--text", action="store_true", help="quality: also int8 with include_text=True")
    parser.add_argument("--no-noise-floor", action="store_true",
                        help="quality: skip the fp64 and perturbed-fp32 rows (fp32's own sensitivity)")
    parser.add_argument("--noise-draws", type=int, default=3,
                        help="quality: perturbed-fp32 runs (pixels x (1 + k * 1e-6), k = 1..N) for fp32's noise band")
    parser.add_argument("--threads", type=int, help="torch threads (default: PyTorch's, one per core)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="what the speed-ups and videos/s are computed from; on a shared machine use "
                             "--threads 1 --clock cpu")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    if args.noise_draws < 0:
        parser.error("--noise-draws must be 0 or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"start: {cpu_description()}", flush=True)
    if args.small:
        args.frames, args.image_size, args.layers, args.temporal_reduction, args.spatial_reduction = 8, 112, 6, 1, 6
    if (args.model is None) != (args.data is None):
        parser.error("--model and --data go together")

    results = {"cpu": cpu_description(), **code_version()}
    print(f"commit {results['commit']}, {results['date']}", flush=True)
    if not args.no_speed:
        results["speed"] = speed(args)
    if args.batches:
        results["throughput"] = throughput(args)
    if args.model is not None:
        results["quality"] = quality(args)
    if "speed" in results and "quality" in results:
        verdicts = results["quality"]["verdicts"]
        median = results["speed"]["median_s"][args.clock]
        row_of = {v: v.replace("-", " ") if v in ENGINE_VARIANTS else PRECISION_OF[v] for v in PRECISION_OF}
        meeting = [v for v in ("testa-int8", "testa-bf16", "testa", *ENGINE_VARIANTS) if v in median
                   and verdicts.get(row_of[v], {}).get("cosine") and verdicts.get(row_of[v], {}).get("recall")]
        if meeting:
            best = min(meeting, key=lambda v: median[v])
            ratio = median["timesformer"] / median[best]
            print(f"\nFastest merged variant meeting the quality contract: {LABELS[best]}, {ratio:.2f}x "
                  f"TimesformerModel fp32 (target >= 6x): {'PASS' if ratio >= 6 else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
