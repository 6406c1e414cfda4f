"""Peak resident memory of an int8 export (issue 49): `optimize_for_inference(vision_model, "int8", backend=...)` on
ViT-B/16 at 32 frames, 224 px (the paper's 32-frame setting R_T=1, R_S=12), with the library's default calibration,
in a fresh process with an empty engine cache: the export, the quantization and one forward, as a user's first call.

    python -m benchmarks.export_memory --backends onnxruntime openvino     # one fresh process per backend, in turn
    python -m benchmarks.export_memory --small                             # a quick look (8 frames, 112 px, 4 layers)

Each backend runs in a child process of its own (``python -m benchmarks.export_memory --child BACKEND``), one after
the other, never two at once. The figure is the child's whole-life peak resident set, read twice: the child's own
``VmHWM`` just before it exits, and ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` in the parent once it has been
waited for (the largest peak of the children waited for so far: shown only where this child raised it). Where the
peak is shows in the steps: the child samples its resident set (`StepPeaks`) during the engine's `export`, its
`quantize`, and the rest of the first forward (loading the graph and running it).
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.encoder_args import add_encoder_arguments, encoder_settings, status_kib

GiB = 2**30


class StepPeaks:
    """Samples this process' resident set every ``interval`` seconds in a thread (``/proc/self/statm``) and keeps
    the highest value seen during each step (`step` names the current one) and each step's seconds. Sampling, not
    ``VmHWM`` resets, so that the process' own high-water mark (and its ``ru_maxrss``) stays its whole life's: a
    step's peak can miss a spike shorter than the interval, the whole-life figures cannot."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.step, self.started = "setup", time.perf_counter()
        self.page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="step-peaks")
        self._thread.start()

    def rss(self) -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * self.page

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = self.rss()
            self.peaks[self.step] = max(self.peaks.get(self.step, 0), rss)
            time.sleep(self.interval)

    def begin(self, step: str) -> None:
        """Ends the current step and starts ``step``."""
        now = time.perf_counter()
        self.seconds[self.step] = self.seconds.get(self.step, 0.0) + now - self.started
        self.peaks[step] = max(self.peaks.get(step, 0), self.rss())
        self.step, self.started = step, now

    def stop(self) -> dict[str, dict[str, float]]:
        self.begin("end")
        self._stop.set()
        self._thread.join()
        return {step: {"peak_gib": self.peaks[step] / GiB, "seconds": self.seconds[step]}
                for step in self.seconds if step != "end"}


def record_steps(engine: type, peaks: StepPeaks) -> None:
    """Wraps the engine's ``export`` and ``quantize`` so that each is a step of its own in ``peaks``; what follows
    the last one (loading the graph, the forward) is the step ``"load and forward"``."""
    for name in ("export", "quantize"):
        original = getattr(engine, name)

        def wrapped(*args, _original=original, _name=name):
            peaks.begin(_name)
            try:
                return _original(*args)
            finally:
                peaks.begin("load and forward")

        setattr(engine, name, staticmethod(wrapped))


def child(args) -> None:
    """One export in this (fresh) process; prints a json line."""
    from modeling_testa import TestaVisionConfig, TestaVisionModel
    from testa_runtimes import optimize_for_inference
    from testa_runtimes.registry import RUNTIMES

    peaks = StepPeaks()
    torch.manual_seed(0)
    config = TestaVisionConfig(**encoder_settings(args), temporal_reduction=args.temporal_reduction,
                               spatial_reduction=args.spatial_reduction)
    model = TestaVisionModel(config).eval()
    record_steps(RUNTIMES[args.child], peaks)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="testa-export-memory-") as cache_dir:
        optimize_for_inference(model, "int8", backend=args.child, cache_dir=cache_dir)  # empty cache: exports
        video = torch.randn(1, args.frames, 3, args.image_size, args.image_size)
        with torch.inference_mode():
            model(video)  # the first forward exports, quantizes, loads and runs
    seconds = time.perf_counter() - start
    print(json.dumps({"backend": args.child, "seconds": seconds, "steps": peaks.stop(),
                      "vm_hwm_gib": status_kib("VmHWM:") * 1024 / GiB}))


def measure(backend: str, args) -> dict:
    """Runs the child for ``backend`` and returns its result with its peak as the parent sees it."""
    command = [sys.executable, "-m", "benchmarks.export_memory", "--child", backend,
               *[f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
                 ("frames", "image_size", "hidden_size", "layers", "heads", "temporal_reduction",
                  "spatial_reduction")]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        raise RuntimeError(f"the {backend} export exited with {done.returncode}:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    # The children's largest peak so far: it is this child's when it rose (or equals the earlier one's).
    result["ru_maxrss_gib"] = after * 1024 / GiB if after > before else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_encoder_arguments(parser, frames=32, temporal_reduction=1, spatial_reduction=12)
    parser.add_argument("--backends", nargs="+", default=["openvino", "onnxruntime"],
                        choices=["openvino", "onnxruntime"])
    parser.add_argument("--small", action="store_true", help="8 frames, 112 px, 4 layers: a quick look")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()
    if args.small:
        args.frames, args.image_size, args.layers, args.spatial_reduction = 8, 112, 4, 4
    if args.child:
        child(args)
        return

    from benchmarks.fast_inference import code_version, cpu_description

    results = {"version": code_version(), "machine": cpu_description(), "python": platform.python_version(),
               "settings": {"frames": args.frames, "image_size": args.image_size, "layers": args.layers,
                            "temporal_reduction": args.temporal_reduction,
                            "spatial_reduction": args.spatial_reduction},
               "backends": {}}
    print(f"# {results['version']['commit']}, {results['version']['date']}; {results['machine']}")
    print("| backend | peak RSS (VmHWM) | peak RSS (RUSAGE_CHILDREN) | seconds | "
          "export: peak, s | quantize: peak, s | load + forward: peak, s |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backends:
        result = measure(backend, args)
        results["backends"][backend] = result
        steps = [result["steps"].get(name) for name in ("export", "quantize", "load and forward")]
        cells = [f"{step['peak_gib']:.2f} GiB, {step['seconds']:.0f}" if step else "-" for step in steps]
        rusage = "-" if result["ru_maxrss_gib"] is None else f"{result['ru_maxrss_gib']:.2f} GiB"
        print(f"| {backend} | {result['vm_hwm_gib']:.2f} GiB | {rusage} | {result['seconds']:.0f} | "
              + " | ".join(cells) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
