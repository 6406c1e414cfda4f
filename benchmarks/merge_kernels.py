"""How many kernels TESTA's merging launches, and how many bytes it moves, counted on the CPU.

    python -m benchmarks.merge_kernels                  # one batch-1 forward, 32 frames, 224 px, ViT-B, 12 blocks
    python -m benchmarks.merge_kernels --backward       # forward + backward
    python -m benchmarks.merge_kernels --train-step     # CPU seconds of an fp32 training step, with and without
    python -m benchmarks.merge_kernels --merge-variants # the library's merge against ToMe's premultiplied one
    python -m benchmarks.merge_kernels --fused          # the fused Triton kernels (GPU path), interpreted on the CPU

**Calls.** The PyTorch profiler records one forward (``--backward``: forward and backward of the sum of the output)
of the TESTA encoder (R_T=1, R_S=12 by default, the paper's setting) and of the same encoder with no aggregation
(R_T=R_S=0), random weights, random video. The merge's *added* calls are the difference, op by op. On a GPU every
counted call is (at least) one kernel launch and some microseconds of host time, whatever the batch size.

What counts as a kernel-launching call (``--rule kernels``, the default): an ATen op at the top of the profiler's
tree (not called by another ATen op: an ``aten::linear`` counts once, not again for its ``aten::addmm``), except

* metadata-only ops, which never touch the data: views and reshapes of strides (``view``, ``expand``, ``slice``,
  ``select``, ``transpose``, ``permute``, ``unsqueeze``, ``squeeze``, ``split``, ``unbind``, ``t``, ``detach``,
  ``alias``, ``as_strided``, ...), ``empty`` tensors that are not filled, ``lift_fresh``, ``promote_types`` /
  ``result_type`` (dtype arithmetic) and the like (:data:`METADATA_ONLY`);
* ops that may return their input unchanged (``to``, ``contiguous``, ``reshape``, ``flatten``, ``dropout``, ...:
  :data:`PASS_THROUGH`), which count only when they did run a kernel below them (a copy, a cast, a mask).

``--fused`` counts the GPU path of `modeling_testa.fused_aggregation`: the geometry matching and its merge as one
Triton kernel each. Triton's interpreter runs the very same kernels on the CPU; every launch runs inside a profiler
range named ``testa::<kernel>``, which counts as one call, and the ATen ops the interpreter itself runs inside it
(copies to and from numpy) are not counted. Its bytes are the kernels' output tensors (merged tokens, sizes,
indices). The decisions and outputs are checked against the PyTorch path in the same run.

``--rule issue`` is the rule of the count quoted in issue 36 (1,164 added calls on the code of d257ac3): the same
top-level ops without the views, but with ``promote_types`` and every ``to`` counted even when it returns its input.

**Bytes** (an estimate, stated as such): the TESTA forward runs once more under a `TorchDispatchMode` that sees the
ops after PyTorch's decompositions, with a flag set while the block runs one of the aggregation functions (matching,
merging, source tracking, the size bias: :data:`AGGREGATION_FUNCTIONS`). Bytes written = the output bytes of every
non-view op inside those functions (for an in-place ``scatter_add_``/``index_add_`` the bytes of the added source
rows, not of the whole tensor). Bytes of int64 indices = the storage bytes of every int64 tensor they create. The
block's own glue (``cat`` of CLS and patches, the residual adds) runs in the encoder without aggregation too and is
not attributed to the merge.

``--merge-variants`` applies one block's two matchings (frames, then patches, ViT-B shapes at ``--frames``) with
the library's merge (`aggregation.merge_bipartite`: the output copied once, the r merged rows updated) and with
:func:`premultiplied_merge` (ToMe's ``merge_wavg``: ``[x * s, s]`` as one tensor, one gather, one scatter, one
division), at batch 1 and ``--variant-batch``, in fp32 and bf16: calls, bytes written and the median CPU time of
``--repeats`` runs, measured in the same process, with the outputs checked to agree.

``--train-step`` times one fp32 training step (forward, backward of the mean of the output, SGD step) of a small
encoder (``--train-*`` options) on the CPU, TESTA against no aggregation, medians of ``--repeats`` steps after one
warm-up, measured in the same process and printed as a ratio.
"""

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from modeling_testa import TestaVisionConfig, TestaVisionModel, aggregation, aggregation_block, fused_aggregation
from testa_runtimes import optimize_for_inference


METADATA_ONLY = frozenset(
    "aten::" + name
    for name in (
        "view", "view_as", "_reshape_alias", "_unsafe_view", "expand", "expand_as", "as_strided", "slice", "select",
        "narrow", "unsqueeze", "squeeze", "transpose", "permute", "t", "movedim", "moveaxis", "swapaxes", "detach",
        "alias", "split", "split_with_sizes", "unbind", "chunk", "unflatten", "diagonal", "unfold", "real", "imag",
        "conj", "_conj", "_neg_view", "resolve_conj", "resolve_neg", "lift_fresh", "empty", "empty_like",
        "empty_strided", "new_empty", "new_empty_strided", "promote_types", "result_type", "is_nonzero", "size",
        "stride", "numel", "dim", "is_same_size", "broadcast_tensors", "_has_compatible_shallow_copy_type",
    )
)
PASS_THROUGH = frozenset(
    "aten::" + name
    for name in ("to", "_to_copy", "contiguous", "reshape", "flatten", "dropout", "feature_dropout", "type_as",
                 "clone_if_needed", "_autocast_to_reduced_precision", "_autocast_to_full_precision", "align_as")
)
ISSUE_RULE_EXCLUDED = frozenset(
    "aten::" + name
    for name in ("view", "expand", "expand_as", "slice", "select", "unsqueeze", "squeeze", "transpose", "permute",
                 "reshape", "flatten", "unbind", "lift_fresh", "dropout", "_reshape_alias", "split", "t", "detach",
                 "alias", "as_strided", "empty", "narrow", "split_with_sizes")
)
AGGREGATION_FUNCTIONS = ("match_frames", "match_tokens", "merge", "_follow_frames", "_follow_patches", "size_bias")
IN_PLACE_SOURCE_ARGUMENT = {"scatter_add_": 3, "index_add_": 3, "scatter_": 3}


# ------------------------------------------------------------------------------------------------------ counting


def launches_kernel(event) -> bool:
    """Whether a profiler event is a kernel-launching ATen call (the module docstring's rule)."""
    if event.name in METADATA_ONLY or not event.name.startswith("aten::"):
        return False
    if event.name in PASS_THROUGH:
        return any(launches_kernel(child) for child in event.cpu_children)
    return True


FUSED_LAUNCH = "testa::"  # the profiler range around a fused kernel's launch (`fused_aggregation`)


def is_top_level(event) -> bool:
    """Not called by another ATen op, nor inside a fused kernel's launch (the interpreter's own ops)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", FUSED_LAUNCH)):
            return False
        parent = parent.cpu_parent
    return True


def count_calls(events, rule: str) -> Counter:
    """Top-level ATen calls by op name under ``rule`` (``"kernels"`` or ``"issue"``), and fused kernel launches."""
    counts = Counter()
    for event in events:
        if event.name.startswith(FUSED_LAUNCH) and is_top_level(event):
            counts[event.name] += 1
            continue
        if not event.name.startswith("aten::") or not is_top_level(event):
            continue
        counted = launches_kernel(event) if rule == "kernels" else event.name not in ISSUE_RULE_EXCLUDED
        if counted:
            counts[event.name.removeprefix("aten::")] += 1
    return counts


def build_encoder(args: argparse.Namespace, reductions: tuple[int, int], **sizes) -> TestaVisionModel:
    settings = dict(num_frames=args.frames, image_size=args.image_size, hidden_size=args.hidden_size,
                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                    intermediate_size=4 * args.hidden_size)
    settings.update(sizes)
    torch.manual_seed(0)
    config = TestaVisionConfig(**settings, temporal_reduction=reductions[0], spatial_reduction=reductions[1],
                               attn_implementation=args.attention)
    return TestaVisionModel(config).to(getattr(torch, args.dtype)).eval()


def run_pass(model: TestaVisionModel, video: torch.Tensor, backward: bool) -> None:
    if backward:
        model(pixel_values=video).last_hidden_state.float().sum().backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.inference_mode():
            model(pixel_values=video)


def profile_calls(model: TestaVisionModel, video: torch.Tensor, backward: bool, warm_up: bool = True
                  ) -> dict[str, Counter]:
    if warm_up:  # lazy initialisations stay out of the count
        run_pass(model, video, backward)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run_pass(model, video, backward)
    events = profile.events()
    return {rule: count_calls(events, rule) for rule in ("kernels", "issue")}


# ----------------------------------------------------------------------------------------------------------- bytes


class MergeTraffic(TorchDispatchMode):
    """Calls, bytes written and int64 index bytes of the non-view ops run while ``active`` (see the docstring)."""

    def __init__(self):
        super().__init__()
        self.active = 0
        self.calls = Counter()
        self.bytes_written = Counter()
        self.index_bytes = 0
        self.largest_index = 0  # elements of the largest int64 tensor created

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.active and not _is_view(func):
            name = func.overloadpacket.__name__
            self.record(name, _written_bytes(name, args, out), out)
        return out

    def record(self, name: str, written: int, outputs) -> None:
        """One call of ``name`` that wrote ``written`` bytes and returned ``outputs``."""
        self.calls[name] += 1
        self.bytes_written[name] += written
        for t in _tensors(outputs):
            if t.dtype == torch.long:
                self.index_bytes += t.untyped_storage().nbytes()
                self.largest_index = max(self.largest_index, t.untyped_storage().nbytes() // t.element_size())


def _is_view(func) -> bool:
    return bool(func.is_view) or "aten::" + func.overloadpacket.__name__ in METADATA_ONLY


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _written_bytes(name: str, args, out) -> int:
    if name in IN_PLACE_SOURCE_ARGUMENT and len(args) > IN_PLACE_SOURCE_ARGUMENT[name]:
        source = args[IN_PLACE_SOURCE_ARGUMENT[name]]
        if isinstance(source, torch.Tensor):
            return source.numel() * source.element_size()
    return sum(t.numel() * t.element_size() for t in _tensors(out))


@contextmanager
def attributed_to_merge(traffic: MergeTraffic):
    """Sets ``traffic.active`` while the block runs one of :data:`AGGREGATION_FUNCTIONS`."""
    originals = {name: getattr(aggregation_block, name) for name in AGGREGATION_FUNCTIONS}

    def scoped(function: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            traffic.active += 1
            try:
                return function(*args, **kwargs)
            finally:
                traffic.active -= 1

        return wrapper

    try:
        for name, function in originals.items():
            setattr(aggregation_block, name, scoped(function))
        with traffic:
            yield traffic
    finally:
        for name, function in originals.items():
            setattr(aggregation_block, name, function)


def merge_traffic(model: TestaVisionModel, video: torch.Tensor, backward: bool) -> MergeTraffic:
    """Forward traffic of the aggregation functions (their backward runs outside them and is not attributed)."""
    traffic = MergeTraffic()
    with attributed_to_merge(traffic), fused_kernel_traffic(traffic):
        with torch.inference_mode():
            model(pixel_values=video)
    return traffic


@contextmanager
def fused_kernel_traffic(traffic: MergeTraffic):
    """Attributes every fused kernel's outputs to ``traffic`` as one call (what it writes), and hides the ops
    Triton's interpreter runs inside the launch."""
    # where they are called from: the fused decisions (`fused_aggregation.fused_bipartite`) and the block's merge
    originals = {(fused_aggregation, "geometry_pairs"): fused_aggregation.geometry_pairs,
                 (aggregation_block, "merge_pairs"): aggregation_block.merge_pairs}

    def counted(name: str, function: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            active, traffic.active = traffic.active, 0
            try:
                outputs = function(*args, **kwargs)
            finally:
                traffic.active = active
            if active:
                traffic.record(FUSED_LAUNCH + name, sum(t.numel() * t.element_size() for t in outputs), outputs)
            return outputs

        return wrapper

    try:
        for (module, name), function in originals.items():
            setattr(module, name, counted(name, function))
        yield traffic
    finally:
        for (module, name), function in originals.items():
            setattr(module, name, function)


# ----------------------------------------------------------------------------------------------------- training


def train_step_seconds(model: TestaVisionModel, video: torch.Tensor, repeats: int) -> float:
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> float:
        start = time.perf_counter()
        model(pixel_values=video).last_hidden_state.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()
    return statistics.median(step() for _ in range(repeats))


def run_train_step(args: argparse.Namespace) -> None:
    sizes = dict(num_frames=args.train_frames, image_size=args.train_image_size, hidden_size=args.train_hidden_size,
                 num_hidden_layers=args.train_layers, num_attention_heads=args.train_heads,
                 intermediate_size=4 * args.train_hidden_size)
    video = torch.randn(args.train_batch, args.train_frames, 3, args.train_image_size, args.train_image_size,
                        generator=torch.Generator().manual_seed(1))
    seconds = {}
    for label, reductions in (("no aggregation", (0, 0)),
                              ("TESTA", (args.temporal_reduction, args.train_spatial_reduction))):
        model = build_encoder(args, reductions, **sizes).float()
        seconds[label] = train_step_seconds(model, video, args.repeats)
    print(f"fp32 training step on the CPU ({torch.get_num_threads()} threads), batch {args.train_batch}, "
          f"{args.train_frames} frames, {args.train_image_size} px, hidden {args.train_hidden_size}, "
          f"{args.train_layers} blocks, R_T={args.temporal_reduction}, R_S={args.train_spatial_reduction}:")
    for label, value in seconds.items():
        print(f"  {label}: {value:.4f} s (median of {args.repeats})")
    print(f"  TESTA speed-up: {seconds['no aggregation'] / seconds['TESTA']:.2f}x")


# ------------------------------------------------------------------------------------------------- merge variants


def premultiplied_merge(x: torch.Tensor, size: torch.Tensor, pairs: aggregation.Bipartite):
    """ToMe's ``merge_wavg`` in the two sets' coordinates, the alternative `merge_bipartite` was measured against:
    sizes travel with the features in one ``[x * s, s]`` tensor (at least fp32), every A token is scattered into the
    B token it joins (unmerged ones into a spare row that is dropped), and one division ends the average."""
    axis = pairs.sources.ndim - 1
    column = size.unsqueeze(-1)
    products = x * column
    weighted = torch.cat([products, column.to(products.dtype)], dim=-1)
    a_set = weighted[(slice(None),) * axis + (slice(pairs.a_start, None, 2),)]
    b_set = weighted[(slice(None),) * axis + (slice(pairs.b_start, None, 2),)]
    num_a, num_b, kept_a = a_set.shape[axis], b_set.shape[axis], pairs.unmerged.shape[-1]
    destinations = torch.full(pairs.sources.shape[:-1] + (num_a,), num_b, dtype=torch.long, device=x.device)
    destinations.scatter_(-1, pairs.sources, pairs.partners)
    expand = lambda index, like: index.view(*index.shape, *(1,) * (like.ndim - index.ndim)).expand(  # noqa: E731
        *index.shape, *like.shape[index.ndim:])
    kept = a_set.gather(axis, expand(pairs.unmerged, a_set))
    sums = torch.cat([weighted.narrow(axis, 0, pairs.protected), kept, b_set, b_set.narrow(axis, 0, 1)], dim=axis)
    sums.narrow(axis, pairs.protected + kept_a, num_b + 1).scatter_add_(axis, expand(destinations, a_set), a_set)
    sums = sums.narrow(axis, 0, sums.shape[axis] - 1)
    return (sums[..., :-1] / sums[..., -1:]).to(x.dtype), sums[..., -1].contiguous()


def one_block_of_merges(merge: Callable, x: torch.Tensor, frame_metric: torch.Tensor, patch_metric: torch.Tensor,
                        spatial_reduction: int):
    """A frame merge (R_T = 1) then a patch merge, as one TESTA block applies them."""
    size = torch.ones(x.shape[:-1])
    frames = aggregation.geometry_matching(frame_metric, 1).bipartite
    x, size = merge(x, size, frames)[:2]
    patches = aggregation.shift_protected(
        aggregation.geometry_matching(patch_metric[:, : x.shape[1]], spatial_reduction, protect_first=True)).bipartite
    return merge(x, size, patches)[:2]


def run_merge_variants(args: argparse.Namespace) -> dict:
    """The table of ``--merge-variants`` (see the module docstring)."""
    results = {}
    patches = (args.image_size // 16) ** 2
    print(f"One block's frame and patch merges, {args.frames} frames, {patches} patches, hidden {args.hidden_size}, "
          f"R_T=1, R_S={args.spatial_reduction}, CPU, {torch.get_num_threads()} threads, median of {args.repeats}:")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, args.variant_batch):
            generator = torch.Generator().manual_seed(2)
            x = torch.randn(batch, args.frames, patches, args.hidden_size, generator=generator).to(dtype)
            frame_metric = torch.randn(batch, args.frames, 64, generator=generator)
            patch_metric = torch.randn(batch, args.frames, patches + 1, 64, generator=generator)
            row = {}
            outputs = {}
            for label, merge in (("library", aggregation.merge_bipartite), ("premultiplied", premultiplied_merge)):
                run = lambda: one_block_of_merges(merge, x, frame_metric, patch_metric,  # noqa: E731
                                                  args.spatial_reduction)
                outputs[label] = run()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                    run()
                traffic = MergeTraffic()
                traffic.active = 1
                with traffic:
                    run()
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                row[label] = dict(calls=sum(count_calls(profile.events(), "kernels").values()),
                                  bytes=sum(traffic.bytes_written.values()), seconds=statistics.median(times))
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(outputs["premultiplied"][0], outputs["library"][0], rtol=tolerance,
                                       atol=tolerance)
            torch.testing.assert_close(outputs["premultiplied"][1], outputs["library"][1], rtol=0, atol=0)
            lib, pre = row["library"], row["premultiplied"]
            print(f"  {str(dtype).removeprefix('torch.'):9s} batch {batch:3d}: library {lib['calls']} calls, "
                  f"{mib(lib['bytes'])}, {lib['seconds'] * 1e3:.1f} ms; premultiplied {pre['calls']} calls, "
                  f"{mib(pre['bytes'])}, {pre['seconds'] * 1e3:.1f} ms; premultiplied / library: "
                  f"{pre['seconds'] / lib['seconds']:.2f}x time, {pre['bytes'] / lib['bytes']:.2f}x bytes")
            results[(str(dtype), batch)] = row
    return results


# ------------------------------------------------------------------------------------------------------- report


def difference(testa: Counter, plain: Counter) -> Counter:
    return Counter({name: testa[name] - plain[name] for name in testa.keys() | plain.keys()
                    if testa[name] != plain[name]})


def mib(value: int) -> str:
    return f"{value / 2**20:.2f} MiB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--temporal-reduction", type=int, default=1)
    parser.add_argument("--spatial-reduction", type=int, default=12)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--backward", action="store_true", help="count forward and backward")
    parser.add_argument("--rule", choices=("kernels", "issue"), default="kernels",
                        help="which calls the table lists (both totals are printed)")
    parser.add_argument("--train-step", action="store_true", help="time a CPU training step instead of counting")
    parser.add_argument("--train-batch", type=int, default=2)
    parser.add_argument("--train-frames", type=int, default=8)
    parser.add_argument("--train-image-size", type=int, default=112)
    parser.add_argument("--train-hidden-size", type=int, default=384)
    parser.add_argument("--train-layers", type=int, default=6)
    parser.add_argument("--train-heads", type=int, default=6)
    parser.add_argument("--train-spatial-reduction", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--merge-variants", action="store_true",
                        help="time the library's merge against ToMe's premultiplied one instead of counting")
    parser.add_argument("--variant-batch", type=int, default=8)
    parser.add_argument("--fused", action="store_true",
                        help="count the fused Triton kernels (the GPU path), run by Triton's interpreter")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.train_step:
        run_train_step(args)
        return {}
    if args.merge_variants:
        return run_merge_variants(args)
    video = torch.randn(args.batch, args.frames, 3, args.image_size, args.image_size,
                        generator=torch.Generator().manual_seed(0), dtype=getattr(torch, args.dtype))
    testa = build_encoder(args, (args.temporal_reduction, args.spatial_reduction))
    plain = build_encoder(args, (0, 0))
    calls_plain = profile_calls(plain, video, args.backward)
    checked = None
    if args.fused:
        if args.backward:
            raise SystemExit("--fused counts inference: the fused kernels have no backward (training merges in "
                             "PyTorch)")
        with torch.inference_mode():
            reference = testa(pixel_values=video, trace_source=True)
        optimize_for_inference(testa, fused_kernels="interpret")  # the runtime's option: Triton's interpreter
        with torch.inference_mode():  # also the warm-up: the interpreter's first launches are not counted
            fused = testa(pixel_values=video, trace_source=True)
        calls_testa = profile_calls(testa, video, args.backward, warm_up=False)
        traffic = merge_traffic(testa, video, args.backward)
        checked = dict(source_map=torch.equal(fused.source_map, reference.source_map),
                       token_sizes=torch.equal(fused.token_sizes, reference.token_sizes),
                       max_difference=(fused.last_hidden_state.double()
                                       - reference.last_hidden_state.double()).abs().max().item())
    else:
        calls_testa = profile_calls(testa, video, args.backward)
        traffic = merge_traffic(testa, video, args.backward)
    added = {rule: difference(calls_testa[rule], calls_plain[rule]) for rule in calls_testa}

    what = "forward + backward" if args.backward else "forward"
    path = " with the fused kernels (Triton's interpreter)" if args.fused else ""
    print(f"One batch-{args.batch} {what}{path}, {args.frames} frames, {args.image_size} px, hidden "
          f"{args.hidden_size}, {args.layers} blocks, {args.dtype}, R_T={args.temporal_reduction}, "
          f"R_S={args.spatial_reduction}:")
    if checked is not None:
        print(f"  against the PyTorch path: same merges (source maps identical: {checked['source_map']}, token sizes "
              f"identical: {checked['token_sizes']}), largest output difference {checked['max_difference']:.3g}")
    for rule in ("kernels", "issue"):
        print(f"  [{rule} rule] encoder without aggregation: {sum(calls_plain[rule].values())} calls; TESTA: "
              f"{sum(calls_testa[rule].values())}; added by the merge: {sum(added[rule].values())}")
    print(f"Added calls by op ({args.rule} rule):")
    for name, count in sorted(added[args.rule].items(), key=lambda item: (-item[1], item[0])):
        print(f"  {name:32s} {count:+d}")
    written = sum(traffic.bytes_written.values())
    print(f"Aggregation functions, forward, after decompositions: {sum(traffic.calls.values())} non-view ops, "
          f"{mib(written)} written ({written} bytes), {mib(traffic.index_bytes)} of int64 indices created "
          f"(the largest: {traffic.largest_index} elements)")
    for name, value in traffic.bytes_written.most_common(8):
        print(f"  {name:32s} {traffic.calls[name]:4d} calls {mib(value):>12s}")
    return dict(plain=calls_plain, testa=calls_testa, added=added, traffic=traffic, checked=checked)


if __name__ == "__main__":
    main()
