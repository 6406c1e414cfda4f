"""Encoder speed on CPU: TESTA with and without aggregation vs transformers' TimesformerModel.

    python -m benchmarks.encoder_speed            # ViT-B/16, 32 frames, 224 px (about 2 minutes on 2 cores)
    python -m benchmarks.encoder_speed --small    # a small config, for a quick look (the demo runs this)
    python -m benchmarks.encoder_speed --dtype bfloat16 --device cuda   # on a GPU

One process, batch 1 (``--batch`` to change), inference mode. The variants are run in turn, ``--repeats`` times
(3 or more: these machines drift by +-10%), and medians are reported with their ratios, so every ratio comes from
one run. Also reported:

* achieved GFLOP/s (2 x the paper-convention GMAC / time) against a plain fp32 matmul measured in the same run;
* peak memory of the forward pass, measured per variant in a fresh subprocess (CPU: growth of the resident set;
  CUDA: ``torch.cuda.max_memory_allocated``);
* a time breakdown of the aggregated encoder (attention linears, MLP, attention, merging, other) from module hooks.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import modeling_testa.aggregation_block as aggregation_block
from modeling_testa import TestaVisionConfig, TestaVisionModel
from modeling_testa.flops import count_encoder_gmac
from benchmarks.encoder_args import add_encoder_arguments, encoder_settings, status_kib


VARIANTS = ("testa-none", "testa", "timesformer")


def build(variant: str, args, attention: str | None = None) -> torch.nn.Module:
    """One of `VARIANTS` with the architecture of ``args`` (`encoder_settings`), on ``args.device`` in
    ``args.dtype``, in eval mode: TESTA without aggregation, TESTA at ``args.temporal_reduction`` and
    ``args.spatial_reduction``, or transformers' `TimesformerModel`. ``attention`` is the attention implementation
    (``"eager"``, ``"sdpa"``; default: transformers' choice); transformers raises a `ValueError` for one the model
    does not support. The weights are initialised on the device (fast on a GPU)."""
    common = encoder_settings(args)
    if attention is not None:
        common["attn_implementation"] = attention
    with torch.device(args.device):
        if variant == "timesformer":
            from transformers import TimesformerConfig, TimesformerModel

            config = TimesformerConfig(**common, attention_type="divided_space_time", qkv_bias=True)
            model = TimesformerModel(config)
        elif variant in VARIANTS:
            reductions = (0, 0) if variant == "testa-none" else (args.temporal_reduction, args.spatial_reduction)
            config = TestaVisionConfig(**common, temporal_reduction=reductions[0], spatial_reduction=reductions[1])
            model = TestaVisionModel(config)
        else:
            raise ValueError(f"Unknown encoder variant {variant!r}; allowed values are {', '.join(VARIANTS)}.")
    return model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


def synchronize(device: str) -> None:
    """Waits for the device's queued work (CUDA), so that wall-clock times cover it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_forward(model, video, device) -> float:
    """Seconds of one inference-mode forward pass of ``model`` on ``video``, synchronised on CUDA."""
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model(pixel_values=video)
    synchronize(device)
    return time.perf_counter() - start


def matmul_gflops(device: str, dtype: torch.dtype, repeats: int = 5) -> float:
    """A plain GEMM the size of a ViT-B MLP layer on 2048 tokens."""
    a = torch.randn(2048, 768, device=device, dtype=dtype)
    w = torch.randn(3072, 768, device=device, dtype=dtype)
    torch.nn.functional.linear(a, w)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.nn.functional.linear(a, w)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * 2048 * 768 * 3072 / statistics.median(times) / 1e9


class Breakdown:
    """Accumulates wall time per category with module hooks and wrapped aggregation functions."""

    AGGREGATION_FUNCTIONS = ("geometry_matching", "importance_matching", "merge_tokens", "shift_protected")

    def __init__(self, model: TestaVisionModel):
        self.totals = defaultdict(float)
        self._starts = {}
        self._handles = []
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("qkv", "projection"):
                self._hook(module, "attention linears (qkv, projection)")
            elif leaf == "temporal_fc":
                self._hook(module, "temporal_fc")
            elif leaf == "mlp":
                self._hook(module, "MLP")
            elif leaf in ("self_attn", "temporal_attention"):
                self._hook(module, "attention modules")
        self._originals = {fn: getattr(aggregation_block, fn) for fn in self.AGGREGATION_FUNCTIONS}
        for fn, original in self._originals.items():
            setattr(aggregation_block, fn, self._timed(original))

    def _hook(self, module, category):
        def pre(mod, args):
            self._starts[id(mod)] = time.perf_counter()

        def post(mod, args, output):
            self.totals[category] += time.perf_counter() - self._starts.pop(id(mod))

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _timed(self, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.totals["merging"] += time.perf_counter() - start
            return result

        return wrapper

    def close(self):
        for handle in self._handles:
            handle.remove()
        for fn, original in self._originals.items():
            setattr(aggregation_block, fn, original)


def measure_memory(variant: str, args) -> float:
    """Peak extra memory (MiB) of one forward pass, in a fresh process so that peaks do not mix."""
    command = [sys.executable, "-m", __spec__.name, "--memory-of", variant] + [a for a in sys.argv[1:] if a != "--memory-of"]
    result = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def memory_child(variant: str, args) -> None:
    model = build(variant, args)
    video = torch.randn(args.batch, args.frames, 3, args.image_size, args.image_size).to(args.device, getattr(torch, args.dtype))
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        time_forward(model, video, args.device)
        print((torch.cuda.max_memory_allocated() - base) / 2**20)
    else:  # Linux: reset the resident-set high-water mark after building, then read it after the forward pass
        Path("/proc/self/clear_refs").write_text("5")
        base = status_kib("VmRSS:")
        time_forward(model, video, args.device)
        print((status_kib("VmHWM:") - base) / 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_encoder_arguments(parser, frames=32, temporal_reduction=1, spatial_reduction=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="8 frames, 112 px, 6 layers: a quick look")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.small:
        args.frames, args.image_size, args.layers, args.temporal_reduction, args.spatial_reduction = 8, 112, 6, 1, 6
    if args.memory_of:
        memory_child(args.memory_of, args)
        return

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    variants = list(VARIANTS)
    models = {v: build(v, args) for v in variants}
    video = torch.randn(args.batch, args.frames, 3, args.image_size, args.image_size).to(args.device, dtype)
    config = models["testa"].config
    gmac = {v: count_encoder_gmac(models["testa-none" if v == "timesformer" else v].config)[0] * args.batch for v in variants}

    for model in models.values():  # warm-up
        time_forward(model, video, args.device)
    times = defaultdict(list)
    matmul = []
    for _ in range(args.repeats):
        matmul.append(matmul_gflops(args.device, dtype))
        for v in variants:
            times[v].append(time_forward(models[v], video, args.device))
    median = {v: statistics.median(t) for v, t in times.items()}
    peak = statistics.median(matmul)

    breakdown = Breakdown(models["testa"])
    for _ in range(max(1, args.repeats // 2)):
        time_forward(models["testa"], video, args.device)
    breakdown.close()
    total = time_forward(models["testa"], video, args.device) * max(1, args.repeats // 2)
    parts = dict(breakdown.totals)
    attention_core = parts.pop("attention modules", 0.0) - parts.get("attention linears (qkv, projection)", 0.0)
    parts["attention (SDPA + key metric)"] = attention_core
    parts["other (embeddings, norms, residuals, reshapes)"] = max(0.0, total - sum(parts.values()))

    memory = {} if args.no_memory else {v: measure_memory(v, args) for v in variants}
    labels = {
        "testa-none": "TESTA, no aggregation",
        "testa": f"TESTA, R_T={args.temporal_reduction}, R_S={args.spatial_reduction}",
        "timesformer": "transformers TimesformerModel",
    }
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"\n{args.frames} frames, {args.image_size} px, hidden {args.hidden_size}, {args.layers} layers, batch {args.batch}, "
        f"{args.dtype}, {device_name}; median of {args.repeats}; plain matmul: {peak:.0f} GFLOP/s\n"
    )
    print("| encoder | GMAC | time (s) | videos/s | speed-up vs ours w/o agg. | speed-up vs Timesformer | GFLOP/s (% of matmul) | peak memory (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        achieved = 2 * gmac[v] / median[v]
        mem = f"{memory[v]:.0f}" if v in memory else "-"
        print(
            f"| {labels[v]} | {gmac[v]:.1f} | {median[v]:.3f} | {args.batch / median[v]:.2f} | "
            f"{median['testa-none'] / median[v]:.2f}x | {median['timesformer'] / median[v]:.2f}x | "
            f"{achieved:.0f} ({100 * achieved / peak:.0f}%) | {mem} |"
        )
    print(f"\nTime breakdown of the aggregated encoder ({labels['testa']}):\n")
    print("| part | time (s) | share |")
    print("|---|---|---|")
    for part, seconds in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"| {part} | {seconds:.3f} | {100 * seconds / total:.1f}% |")
    if args.json:
        args.json.write_text(json.dumps(dict(times=times, median=median, gmac=gmac, matmul_gflops=peak,
                                             memory_mib=memory, breakdown=parts, config=config.to_dict()), indent=1))


if __name__ == "__main__":
    main()
