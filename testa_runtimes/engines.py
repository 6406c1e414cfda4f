"""The TESTA video encoder exported with its merging, run by OpenVINO or ONNX Runtime.

`optimize_for_inference(model, backend="openvino" | "onnxruntime", precision=...)` (in `inference.py`) gives a model's
`TestaVisionModel` a runtime (`runtimes.OpenVINORuntime`, `runtimes.OnnxRuntimeRuntime`) that runs an
`ExportedEncoder` with its engine. **One class per engine** (`OpenVINOEngine`, `OnnxRuntimeEngine`, registered in
`ENGINES`, as Optimum has one model class per engine) owns everything that engine does: its export, int8
quantization, loading, running, file names, package extra and the settings it cannot express. The whole encoder
(embeddings, every block with its frame and patch matching and merging, the final LayerNorm) is one graph, exported
once per input shape (frames, height, width; the batch is dynamic) and kept on disk.

**Export.** `torch.export` traces the encoder for the settings it has (one R per block, the strategy, ...): the token
counts after every merge are fixed by the settings and the input shape, so the graph is static but for the batch.
OpenVINO converts the `ExportedProgram` (`openvino.convert_model`); ONNX goes through `torch.onnx.export(dynamo=True)`
with one translation added: the stable `argsort`/`sort` of the matching becomes ONNX `TopK` over the whole axis, whose
ties go to the lower index (as a stable sort's do). The size-weighted merge is already a sum scatter plus a count
scatter (`aggregation.merge_tokens`), which ONNX `ScatterElements(reduction="add")` expresses; no mean scatter is used.
Exported fp32 equals PyTorch fp32: same merge decisions (the source map), same outputs to float rounding.

**Precisions.**

- ``"fp32"``: OpenVINO with ``INFERENCE_PRECISION_HINT=f32`` (set explicitly: on CPUs with bf16 instructions its
  default is bf16), ONNX Runtime as exported.
- ``"bf16"`` (OpenVINO, CPUs with AVX-512 BF16 or AMX): the linear layers compute in bf16 and everything else in
  fp32, as PyTorch's bf16 does: `linear_layers_in_bf16` converts their inputs and weights to bf16 in the graph, which
  is compiled with the f32 hint. (OpenVINO's own bf16 hint also rounds the key similarities of the matching to bf16,
  and took none of fp32's merge decisions on the demo's videos.)
- ``"int8"``: post-training static quantization by the engine's own tools, calibrated on a few videos
  (`calibration`, default `default_calibration_videos`): NNCF (`nncf.quantize`, transformer preset) for OpenVINO,
  `onnxruntime.quantization.quantize_static` (QDQ, weights per channel) for ONNX Runtime. The matrix multiplies
  whose results decide the matching (`matching_matmuls`: the key similarities, and Eq. 1's attention for the
  importance strategy) are excluded from quantization and stay fp32, and so is the temporal attention's output
  branch (its projection and ``temporal_fc``: `attention_output_matmuls`), whose int8 error flipped merge decisions
  on repeated frames. For OpenVINO that branch is folded into one layer first (`fold_linear_pairs`: the two are
  linear maps in a row at inference), computed in bf16 where the CPU has bf16 instructions: it then costs about
  what it cost in int8. For ONNX Runtime, whose export has the attention unfused and whose quantization has no
  SmoothQuant, the attention's own products (queries times keys, probabilities times values:
  `attention_product_matmuls`) and the projections that compute the matching's keys (`key_projection_matmuls`)
  stay fp32 too. Activation scales are static, so a video's embedding does not depend on the other videos of its
  batch. ONNX Runtime's calibration runs in bounded memory (`onnx_calibration_ranges`: the ranges of
  `quantize_static`'s own calibrator, whose graph runs in the priority-based order).

**Cache.** An export is saved under ``cache_dir`` (default ``$HF_HOME/testa/engines``) in a folder named by
`cache_key`: the weights' SHA-256, the full vision config (aggregation settings included), the input shape, backend,
precision, the calibration videos' SHA-256 (int8) and the library versions. A change of any of them exports again;
`set_aggregation` after `optimize_for_inference` is picked up at the next call.

What an export cannot express is refused by name: ``output_hidden_states`` and ``output_attentions`` by the runtime
(`runtimes.ExportedRuntime`), the settings an engine lists in ``unsupported_settings`` by `Engine.check_settings`.

This file is Hub remote code (the pipelines import `inference`, which imports it): flat relative imports only.
"""

import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from modeling_testa.aggregation import snap_scores
from testa_runtimes.fingerprints import tensor_fingerprint
from modeling_testa.aggregation_block import sequence, token_sizes_with_cls
from modeling_testa.modeling_testa_vision import TestaVisionModelOutput


logger = logging.getLogger(__name__)

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


# ----------------------------------------------------------------------------------------------------------------------
# The CPU, the backends
# ----------------------------------------------------------------------------------------------------------------------


def cpu_flags() -> set[str]:
    """The x86 feature flags of this CPU (``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_bf16(flags: set[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX-512 BF16 or AMX)."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in BF16_FLAGS)


def cpu_has_vnni(flags: set[str] | None = None) -> bool:
    """Whether the CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX)."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in INT8_FLAGS)


# ----------------------------------------------------------------------------------------------------------------------
# The graph
# ----------------------------------------------------------------------------------------------------------------------


class EncoderGraph(nn.Module):
    """What is exported (or captured as a CUDA graph): ``pixel_values -> (last_hidden_state, token_sizes[,
    source_map])`` of a `TestaVisionModel` with its settings at export time (``source_map`` when ``trace_source``;
    ``fused_kernels``: the capturing runtime's option, `fused_aggregation.FUSED_KERNELS`; exporters never see them)."""

    def __init__(self, vision_model: nn.Module, trace_source: bool, fused_kernels: str = "auto") -> None:
        super().__init__()
        self.vision_model = vision_model
        self.trace_source = trace_source
        self.fused_kernels = fused_kernels

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model = self.vision_model  # its blocks, not its forward (which hands calls to the model's runtime)
        state = model.run_blocks(pixel_values, model.aggregation_settings(self.trace_source),
                                 fused_kernels=self.fused_kernels)
        outputs = (model.post_layernorm(sequence(state)), token_sizes_with_cls(state))
        return outputs + ((state.source_map,) if self.trace_source else ())


def default_calibration_videos(frames: int, height: int, width: int, count: int = 4, channels: int = 3,
                               seed: int = 0) -> torch.Tensor:
    """``count`` deterministic videos ``(count, frames, channels, height, width)`` for int8 calibration when none are
    given: smooth random images (noise on a coarse grid, upsampled) that drift and change between scenes, at the
    scale of normalised pixels. Real videos of the target domain calibrate better: pass them as ``calibration``."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.randn(count, 2, channels, max(height // 16, 2), max(width // 16, 2), generator=generator)
    scenes = F.interpolate(coarse.flatten(0, 1), size=(height, width), mode="bicubic", align_corners=False)
    scenes = scenes.view(count, 2, channels, height, width)
    videos = []
    for t in range(frames):
        scene = scenes[:, 0] if t < frames // 2 else scenes[:, 1]  # a cut halfway
        shift = (t * max(width // 32, 1)) % width  # a slow pan
        videos.append(torch.roll(scene, shifts=shift, dims=-1))
    videos = torch.stack(videos, dim=1)
    return videos + 0.1 * torch.randn(videos.shape, generator=generator)


# ----------------------------------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$HF_HOME/testa/engines`` (the Hugging Face cache home)."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "testa" / "engines"


def graph_code_fingerprint() -> str:
    """SHA-256 of the source of the modules that define the exported graph (the encoder, its blocks, the matching and
    merging, the export itself): a graph exported by other code is never reused (it could merge other tokens than the
    PyTorch model does). The score grid the decisions are taken on is a setting of the config, keyed with it."""
    defining = (snap_scores, sequence, TestaVisionModelOutput)  # aggregation, aggregation_block, the vision model
    modules = [sys.modules[item.__module__] for item in defining] + [sys.modules[__name__]]
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def library_versions(packages: Iterable[str] = ()) -> dict[str, str]:
    """The versions an export depends on (torch, transformers, the engine's ``packages``) and the code that defines
    the graph (`graph_code_fingerprint`)."""
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "graph_code": graph_code_fingerprint()}
    for module in packages:
        versions[module] = getattr(__import__(module), "__version__", "?")
    return versions


def cache_key(weights_sha256: str, config: dict[str, Any], backend: str, precision: str, shape: tuple[int, ...],
              trace_source: bool, calibration_sha256: str | None, versions: dict[str, str]) -> str:
    """SHA-256 of everything an export depends on: the weights, the vision config (aggregation settings included),
    backend, precision, input shape (frames, channels, height, width), source tracing, the calibration videos (int8)
    and the library versions."""
    settings = {"weights": weights_sha256, "config": config, "backend": backend, "precision": precision,
                "shape": list(shape), "trace_source": bool(trace_source), "calibration": calibration_sha256,
                "versions": versions}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def config_settings(vision_model: nn.Module) -> dict[str, Any]:
    """The vision config as a dict, without the fields that do not change the exported graph."""
    settings = vision_model.config.to_dict()
    for name in ("_name_or_path", "transformers_version", "output_hidden_states", "output_attentions",
                 "trace_source", "return_dict", "_attn_implementation_autoset"):
        settings.pop(name, None)
    return settings


# ----------------------------------------------------------------------------------------------------------------------
# Which matrix multiplies decide the matching
# ----------------------------------------------------------------------------------------------------------------------


def matching_matmuls(nodes: dict[str, tuple[str, list[str]]], matmul_types: tuple[str, ...] = ("MatMul",),
                     sort_types: tuple[str, ...] = ("TopK",)) -> list[str]:
    """The matrix multiplies whose results feed a sort without passing another matrix multiply: the key similarity
    scores (and Eq. 1's attention for the importance strategy). Walking up from every sort, each path stops at the
    first matrix multiply, so the projections that compute the keys (one multiply further up) are not included.

    Args:
        nodes: ``name -> (op type, names of the nodes producing its inputs)``.
    """
    return first_matmuls_above(nodes, [name for name, (kind, _) in nodes.items() if kind in sort_types], matmul_types)


def key_projection_matmuls(nodes: dict[str, tuple[str, list[str]]], matmul_types: tuple[str, ...] = ("MatMul",)
                           ) -> list[str]:
    """The matrix multiplies that compute the matching's keys: walking up from the inputs of every
    `matching_matmuls` product, each path stops at the first matrix multiply (the attentions' query-key-value
    projections). ONNX Runtime's int8 keeps them in fp32 (`quantize_onnx`): without SmoothQuant its per-tensor
    activation scale moved the demo's merge decisions (three videos below cosine 0.99)."""
    starts = [i for name in matching_matmuls(nodes, matmul_types) for i in nodes[name][1] if i in nodes]
    return first_matmuls_above(nodes, starts, matmul_types)


def first_matmuls_above(nodes: dict[str, tuple[str, list[str]]], starts: Iterable[str],
                        matmul_types: tuple[str, ...] = ("MatMul",)) -> list[str]:
    """The first matrix multiply on every path up from ``starts`` (a start that is one is its own)."""
    found = set()

    def upwards(name: str) -> Iterable[str]:
        kind, inputs = nodes[name]
        if kind in matmul_types:
            found.add(name)
            return ()
        return (i for i in inputs if i in nodes)

    walk_graph(starts, upwards)
    return sorted(found)


def walk_graph(starts: Iterable[str], visit: Callable[[str], Iterable[str]]) -> None:
    """Breadth-first over node names from ``starts``: ``visit(name)`` runs once per node and returns where to go
    next."""
    seen, queue = set(), deque(starts)
    while queue:
        name = queue.popleft()
        if name not in seen:
            seen.add(name)
            queue.extend(visit(name))


def fed_by(nodes: dict[str, tuple[str, list[str]]], name: str, kinds: tuple[str, ...]) -> bool:
    """Whether node ``name`` has an input produced by a node of one of ``kinds``."""
    return any(nodes.get(i, ("",))[0] in kinds for i in nodes[name][1])


def attention_output_matmuls(nodes: dict[str, tuple[str, list[str]]], matmul_types: tuple[str, ...] = ("MatMul",),
                             attention_types: tuple[str, ...] = ("ScaledDotProductAttention",),
                             shape_types: tuple[str, ...] = ("ShapeOf", "Shape"), min_chain: int = 1) -> list[str]:
    """The matrix multiplies between an attention and its residual add: the attention's output projection and, in a
    divided block's temporal branch, ``temporal_fc`` after it. With ``min_chain=2`` only the chains of two or more
    (the temporal branches): the layers whose int8 error flipped merge decisions on the demo's videos.

    Why those: on repeated or near-repeated frames, the temporal attention's output carries the small differences
    between frames that the later blocks' frame matching decides on, and one per-tensor int8 scale for its
    activations rounds them away. Keeping the temporal branch in fp32 fixed the demo's two videos whose embeddings
    had moved (cosine 0.98); the spatial projections or every other layer group in fp32 did not (docs/inference.md,
    "Agreement between runtimes").

    An attention is a fused attention node (``attention_types``) or a matrix multiply fed by a ``Softmax`` (the
    attention probabilities times the values, as an unfused export has it). From each, the walk goes down through
    every consumer and stops at the residual add (an ``Add`` of two computed tensors; a bias add has a constant or
    initializer input) and at shape reads. Selected by what the nodes compute, not by their names.

    Args:
        nodes: ``name -> (op type, names of the nodes producing its inputs)`` (`openvino_nodes`, `onnx_nodes`).
    """
    consumers: dict[str, list[str]] = {name: [] for name in nodes}
    for name, (_, inputs) in nodes.items():
        for producer in inputs:
            if producer in consumers:
                consumers[producer].append(name)

    def computed(name: str) -> bool:
        return name in nodes and nodes[name][0] != "Constant"

    def is_attention(name: str) -> bool:
        kind = nodes[name][0]
        return kind in attention_types or (kind in matmul_types and fed_by(nodes, name, ("Softmax",)))

    def chain(attention: str) -> set[str]:
        found = set()

        def downwards(name: str) -> Iterable[str]:
            kind, inputs = nodes[name]
            if kind in shape_types or (kind == "Add" and sum(map(computed, inputs)) >= 2):
                return ()
            if kind in matmul_types:
                found.add(name)
            return consumers[name]

        walk_graph(consumers[attention], downwards)
        return found

    chains = [chain(name) for name in nodes if is_attention(name)]
    return sorted(set().union(*[c for c in chains if len(c) >= min_chain]))


FOLDED_SUFFIX = "/testa_folded"
"""The end of the friendly name of a linear layer that `fold_linear_pairs` made of two."""


def _linear_parts(node: Any) -> tuple[Any, Any] | None:
    """``(weight (out, in) float64, the input)`` of a matrix multiply by a constant fp32 weight, else None."""
    import numpy as np

    if node.get_type_name() != "MatMul" or node.get_attributes()["transpose_a"]:
        return None
    weight = node.input_value(1).get_node()
    if weight.get_type_name() != "Constant" or weight.get_output_element_type(0).get_type_name() != "f32":
        return None
    matrix = np.asarray(weight.get_data(), dtype=np.float64)
    if matrix.ndim != 2:
        return None
    return (matrix if node.get_attributes()["transpose_b"] else matrix.T), node.input_value(0)


def _only_consumer(node: Any) -> Any | None:
    targets = list(node.output(0).get_target_inputs())
    return targets[0].get_node() if len(targets) == 1 else None


def _constant_bias(node: Any) -> Any | None:
    """The constant vector an ``Add`` adds (a linear layer's bias), else None."""
    import numpy as np

    if node is None or node.get_type_name() != "Add":
        return None
    constants = [node.input_value(i).get_node() for i in range(2)
                 if node.input_value(i).get_node().get_type_name() == "Constant"]
    return np.asarray(constants[0].get_data(), dtype=np.float64).reshape(-1) if len(constants) == 1 else None


def fold_linear_pairs(model: Any, names: Iterable[str]) -> list[str]:
    """Folds, in an OpenVINO model, every pair of linear layers among ``names`` whose first feeds only the second
    (through its bias at most) into one layer: ``(x W1^T + b1) W2^T = x (W2 W1)^T + W2 b1``, the products computed in
    float64 and stored in fp32. The second layer's bias stays where it is. Returns the names of the layers of
    ``names`` the model has now: the folded ones (the first layer's name and `FOLDED_SUFFIX`) and those left alone.

    Why: at inference the temporal attention's projection feeds ``temporal_fc`` directly, two linear maps in a row.
    int8 keeps that branch out of quantization (`attention_output_matmuls`), and as one layer it costs half as much
    (docs/inference.md, "Speed of the exported encoders")."""
    from openvino import opset13 as ops

    names = set(names)
    by_name = {node.get_friendly_name(): node for node in model.get_ops()}
    remaining = set(names)
    for name in sorted(names):
        first = by_name[name]
        first_parts = _linear_parts(first)
        after = _only_consumer(first)
        bias = _constant_bias(after)
        second = _only_consumer(after) if bias is not None else after
        second_parts = _linear_parts(second) if second is not None else None
        if first_parts is None or second_parts is None or second.get_friendly_name() not in names:
            continue
        if bias is not None and bias.shape[0] != first_parts[0].shape[0]:  # not one bias per output
            continue
        (w1, x), (w2, _) = first_parts, second_parts
        folded = ops.matmul(x, ops.constant((w2 @ w1).astype("float32")), False, True)
        folded.set_friendly_name(name + FOLDED_SUFFIX)
        output = folded if bias is None else ops.add(folded, ops.constant((w2 @ bias).astype("float32")))
        for target in list(second.output(0).get_target_inputs()):
            target.replace_source_output(output.output(0))
        remaining -= {name, second.get_friendly_name()}
        remaining.add(name + FOLDED_SUFFIX)
    model.validate_nodes_and_infer_types()
    return sorted(remaining)


def attention_product_matmuls(nodes: dict[str, tuple[str, list[str]]], matmul_types: tuple[str, ...] = ("MatMul",),
                               softmax_types: tuple[str, ...] = ("Softmax",)) -> list[str]:
    """The attention's own matrix products in an unfused graph: queries times keys (the first matrix multiply above
    each ``Softmax``, as `matching_matmuls` walks up from a sort) and the probabilities times the values (a matrix
    multiply fed by a ``Softmax``). NNCF leaves these to OpenVINO's fused attention in fp32; ONNX Runtime's static
    QDQ quantization gives both operands one int8 scale per tensor (`quantize_onnx` keeps them in fp32).

    Args:
        nodes: ``name -> (op type, names of the nodes producing its inputs)`` (`onnx_nodes`).
    """
    scores = matching_matmuls(nodes, matmul_types=matmul_types, sort_types=softmax_types)
    weighted = [name for name, (kind, _) in nodes.items() if kind in matmul_types and fed_by(nodes, name, softmax_types)]
    return sorted(set(scores) | set(weighted))


def openvino_nodes(model: Any) -> dict[str, tuple[str, list[str]]]:
    """`matching_matmuls`' view of an OpenVINO model (by friendly name)."""
    return {op.get_friendly_name(): (op.get_type_name(), [i.get_source_output().get_node().get_friendly_name()
                                                          for i in op.inputs()]) for op in model.get_ops()}


def onnx_nodes(graph: Any) -> dict[str, tuple[str, list[str]]]:
    """`matching_matmuls`' view of an ONNX graph (by node name)."""
    producer = {output: node.name for node in graph.node for output in node.output}
    return {node.name: (node.op_type, [producer[i] for i in node.input if i in producer]) for node in graph.node}


def onnx_calibration_ranges(path: Path, samples: Iterable[dict[str, Any]], op_types: list[str], work_dir: Path
                            ) -> Path:
    """The activation ranges of `quantize_static`'s own calibration (its MinMax calibrator with the settings
    `OnnxRuntimeEngine.quantize` gives it: the inputs and outputs of ``op_types``, global minimum and maximum, not
    symmetric), computed in bounded memory, saved in ``work_dir`` as the JSON file that
    ``quantize_static(calibration_cache_path=...)`` reads instead of calibrating. ``samples`` (the model's inputs,
    one video each) are run one at a time.

    Why not `quantize_static`'s calibration itself: its calibrator adds a ReduceMin and a ReduceMax of every
    calibrated tensor as outputs of the graph and runs that graph in ONNX Runtime's default execution order, which
    runs the reductions after the rest of the graph. Every tensor the quantized matrix multiplies read or write was
    then kept until the end of each video: 12.6 GiB resident for the 32-frame ViT-B/16 (issue 49), whose export and
    int8 forward peak below 3 (`benchmarks/export_memory.py`). Keeping fewer videos does not help: the calibrator
    keeps only the reduced values, and its option to keep fewer, ``CalibMaxIntermediateOutputs``, drops them
    unmerged in onnxruntime 1.32 (the calibration then fails with "No data is collected"). Here the same calibrator
    runs its graph in the priority-based order (``ExecutionOrder.PRIORITY_BASED``), which reduces each tensor as
    soon as it exists, so that it can be freed; the order changes no value, and the ranges equal `quantize_static`'s
    own (tests/test_engines.py)."""
    import onnxruntime as ort
    from onnxruntime.quantization import MinMaxCalibrater, save_tensors_data

    calibrator = MinMaxCalibrater(Path(path), op_types, augmented_model_path=str(work_dir / "augmented.onnx"))
    calibrator.augment_graph()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as the calibrator's own session
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    calibrator.infer_session = ort.InferenceSession(calibrator.augmented_model_path, options,
                                                    providers=["CPUExecutionProvider"])

    class Reader:  # what `collect_data` asks of a `CalibrationDataReader`
        def __init__(self) -> None:
            self.samples = iter(samples)

        def get_next(self) -> dict[str, Any] | None:
            return next(self.samples, None)

    calibrator.collect_data(Reader())  # keeps each video's minimum and maximum per tensor, merged at the end
    ranges = work_dir / "ranges.json"
    save_tensors_data(calibrator.compute_data(), ranges)
    return ranges


# ----------------------------------------------------------------------------------------------------------------------
# The engines: one class each
# ----------------------------------------------------------------------------------------------------------------------


def export_program(graph: EncoderGraph, example: torch.Tensor) -> Any:
    """`torch.export` of the encoder graph with a dynamic batch."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    with torch.no_grad():
        return torch.export.export(graph, (example,), dynamic_shapes=({0: batch},))


def sort_as_topk(self, stable: bool = False, dim: int = -1, descending: bool = False):
    """ONNX translation of ``aten.sort.stable``: `TopK` over the whole axis. ONNX's TopK puts the lower index first
    among equal values, which is what a stable sort does."""
    from onnxscript import opset18 as op

    k = op.Gather(op.Shape(self), op.Constant(value_ints=[dim]))
    values, indices = op.TopK(self, k, axis=dim, largest=descending, sorted=True)
    return values, indices


_OPENVINO_CORE: list = []
_OPENVINO_CORE_LOCK = threading.Lock()


def openvino_core() -> Any:
    """The one `openvino.Core` of this process, created at first use and never destroyed before exit.

    Why one: OpenVINO's CPU plugin gives the thread that compiles or runs a model an alternate signal stack
    (``sigaltstack``) of its own, saving the thread's previous one, and puts the saved one back when its `Core` is
    destroyed. With a `Core` per graph, destroyed in another order than created (as garbage collection does), a
    thread is left with an alternate stack that was freed: the next signal with a Python handler (CPython installs
    them with ``SA_ONSTACK``; e.g. the SIGCHLD of a DataLoader worker or of a helper process) cannot be delivered, and
    the kernel kills the process with SIGSEGV, without a traceback (faulthandler runs on that stack too). That was the
    segfault of long pytest runs, mid-run and at exit (`tests/test_engines.py`
    `test_openvino_graphs_freed_in_any_order_leave_signals_deliverable`, docs/inference.md)."""
    with _OPENVINO_CORE_LOCK:
        if not _OPENVINO_CORE:
            import openvino as ov

            _OPENVINO_CORE.append(ov.Core())
        return _OPENVINO_CORE[0]


def linear_layers_in_bf16(model: Any, selected: Callable[[str], bool] | None = None) -> int:
    """Makes every matrix multiply by a constant weight (the encoder's linear layers; with ``selected``, those whose
    friendly name it accepts) compute in bf16 inside an
    OpenVINO model: its input and weight are converted to bf16 and its output back to fp32, so the CPU plugin, compiled
    with the f32 hint, runs these layers with bf16 kernels and everything else (LayerNorms, residuals, attention,
    the matching's similarities and rounding, the merge) in fp32, as PyTorch's bf16 (`linear_layers.Bf16Linear`)
    does. Returns how many layers were converted.

    Why not the plugin's bf16 hint: it also runs the key normalisation, the similarity products and the score
    rounding in bf16 (fused into one bf16 MatMul with the rounding as a post-op), so no merge decision matched
    fp32's on the demo's videos. Marking those nodes to stay fp32 (the ``DisablePrecisionConversion`` runtime
    attribute, which Python can only set through the IR's ``rt_info``) kept the nodes the plugin keeps, but its fusions
    build new nodes without the mark; docs/inference.md, "Agreement between runtimes", has the numbers."""
    from openvino import opset13 as ops

    converted = 0
    for node in list(model.get_ordered_ops()):
        weight = node.input_value(1) if node.get_type_name() == "MatMul" else None
        if weight is None or weight.get_node().get_type_name() != "Constant":
            continue
        if selected is not None and not selected(node.get_friendly_name()):
            continue
        attributes = node.get_attributes()
        product = ops.matmul(ops.convert(node.input_value(0), "bf16"), ops.convert(weight, "bf16"),
                             attributes["transpose_a"], attributes["transpose_b"])
        product.set_friendly_name(node.get_friendly_name())
        output = ops.convert(product, node.get_output_element_type(0))
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(output.output(0))
        converted += 1
    model.validate_nodes_and_infer_types()
    return converted


class Engine:
    """One inference engine that runs the exported encoder on the CPU, as one class: what it is called and needs
    (``name``, ``extra``, ``packages``), the precisions it offers, the settings it cannot express, its file names,
    how it exports (`export`), quantizes to int8 (`quantize`), reads its graphs (`graph_nodes`), and, as an
    instance, one loaded graph (``numpy pixel_values -> list of numpy outputs``). The exported runtimes
    (`runtimes.ExportedRuntime`) and `ExportedEncoder` use an engine only through this interface; `ENGINES` is the
    registry.

    Class attributes:
        name: the ``backend`` name `optimize_for_inference` knows it by.
        extra, packages: the package extra that installs it, and the modules it needs.
        precisions: the precisions it offers (bf16 where the CPU has bf16 instructions: `check_precision`).
        graph_file: the fp32 graph's file name; int8's adds ``_int8`` (`file_name`).
        unsupported_settings: config settings ``"name=value"`` its exporter cannot express (refused by
            `check_settings`).
        matmul_types, attention_types, quantizer_type: its graphs' node types of a matrix multiply, of a fused
            attention and of a quantization step (what the selections of the matching's products read).
    """

    name: ClassVar[str] = ""
    extra: ClassVar[str] = ""
    packages: ClassVar[tuple[str, ...]] = ()
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "int8")
    graph_file: ClassVar[str] = ""
    unsupported_settings: ClassVar[tuple[str, ...]] = ()
    matmul_types: ClassVar[tuple[str, ...]] = ("MatMul",)
    attention_types: ClassVar[tuple[str, ...]] = ()
    quantizer_type: ClassVar[str] = ""

    @classmethod
    def file_name(cls, precision: str) -> str:
        """The file of the graph of ``precision`` in its cache folder (bf16 loads the fp32 file)."""
        stem, suffix = cls.graph_file.rsplit(".", 1)
        return f"{stem}_int8.{suffix}" if precision == "int8" else cls.graph_file

    @classmethod
    def check_settings(cls, vision_model: nn.Module) -> None:
        """Raises `ValueError` naming a setting of the model this engine cannot export (checked again at every
        export: `set_aggregation` may change them)."""
        config = vision_model.config
        for setting in cls.unsupported_settings:
            name, value = setting.split("=")
            if str(getattr(config, name)) == value:
                raise ValueError(f"backend={cls.name!r} cannot export a TESTA encoder with {setting}; use "
                                 "backend='torch' for this setting.")

    @classmethod
    def check_precision(cls, precision: str) -> None:
        """Raises `ValueError` for a precision this CPU cannot run fast (bf16 without bf16 instructions)."""
        if precision == "bf16" and not cpu_has_bf16():
            raise ValueError(f"precision='bf16' with backend={cls.name!r} needs a CPU with bf16 instructions "
                             f"({' or '.join(BF16_FLAGS)}); this CPU has neither, and emulated bf16 is slower than "
                             "fp32. Use precision='int8' or 'fp32'.")

    @classmethod
    def versions(cls) -> dict[str, str]:
        """What an export by this engine depends on (`library_versions` of its packages)."""
        return library_versions(cls.packages)

    @classmethod
    def export(cls, graph: EncoderGraph, example: torch.Tensor, folder: Path) -> Path:
        """Exports the fp32 graph into ``folder`` (as `file_name` ``("fp32")``); returns its path."""
        raise NotImplementedError

    @classmethod
    def quantize(cls, path: Path, calibration: torch.Tensor, folder: Path) -> Path:
        """int8 of the fp32 graph at ``path``, calibrated on ``calibration`` (one video per sample), the matching's
        products and the temporal attention's output branch left out; returns the int8 graph's path."""
        raise NotImplementedError

    @classmethod
    def graph_nodes(cls, path: Path) -> dict[str, tuple[str, list[str]]]:
        """``name -> (op type, names of the nodes producing its inputs)`` of the graph file ``path``."""
        raise NotImplementedError

    def __init__(self, path: Path, precision: str) -> None:
        """Loads the graph at ``path`` to run it in ``precision``, with as many threads as PyTorch uses
        (`torch.set_num_threads`), so that comparisons are like for like."""
        raise NotImplementedError

    def __call__(self, pixel_values: Any) -> list[Any]:
        raise NotImplementedError


class OpenVINOEngine(Engine):
    """OpenVINO on the CPU: IR converted from `torch.export`; fp32 (the ``f32`` inference hint: on CPUs with bf16
    instructions its default is bf16), bf16 (the linear layers in bf16, in the graph: `linear_layers_in_bf16`), int8
    by NNCF."""

    name = "openvino"
    extra = "openvino"
    packages = ("openvino", "nncf")
    precisions = ("fp32", "bf16", "int8")
    graph_file = "encoder.xml"
    attention_types = ("ScaledDotProductAttention",)
    quantizer_type = "FakeQuantize"

    @classmethod
    def export(cls, graph: EncoderGraph, example: torch.Tensor, folder: Path) -> Path:
        import openvino as ov

        model = ov.convert_model(export_program(graph, example))
        path = folder / cls.file_name("fp32")
        ov.save_model(model, str(path), compress_to_fp16=False)
        return path

    @classmethod
    def quantize(cls, path: Path, calibration: torch.Tensor, folder: Path) -> Path:
        """NNCF post-training int8 (transformer preset). Left in fp32: the matching's products
        (`matching_matmuls`) and the temporal attention's output branch, folded into one layer first
        (`fold_linear_pairs`; bf16 where the CPU has it, when loaded)."""
        import nncf
        import openvino as ov

        model = openvino_core().read_model(str(path))
        temporal_branch = fold_linear_pairs(model, attention_output_matmuls(openvino_nodes(model), min_chain=2))
        ignored = sorted(set(matching_matmuls(openvino_nodes(model))) | set(temporal_branch))
        dataset = nncf.Dataset([video[None].numpy() for video in calibration])
        quantized = nncf.quantize(model, dataset, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(calibration),
                                  ignored_scope=nncf.IgnoredScope(names=ignored, validate=False))
        out = folder / cls.file_name("int8")
        ov.save_model(quantized, str(out), compress_to_fp16=False)
        return out

    @classmethod
    def graph_nodes(cls, path: Path) -> dict[str, tuple[str, list[str]]]:
        return openvino_nodes(openvino_core().read_model(str(path)))

    def __init__(self, path: Path, precision: str) -> None:
        core = openvino_core()
        model = core.read_model(str(path))
        if precision == "bf16":
            linear_layers_in_bf16(model)
        elif precision == "int8" and cpu_has_bf16():  # int8's fp32 exception, at twice fp32's speed
            linear_layers_in_bf16(model, selected=lambda name: name.endswith(FOLDED_SUFFIX))
        # The hint is f32 for every precision: int8 graphs keep their other parts in fp32, and bf16 is in the graph
        # itself (`linear_layers_in_bf16`), since the plugin's bf16 hint would round everything else too.
        self.compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                          "PERFORMANCE_HINT": "LATENCY",
                                                          "INFERENCE_NUM_THREADS": torch.get_num_threads()})

    def __call__(self, pixel_values: Any) -> list[Any]:
        result = self.compiled(pixel_values)
        return [result[i] for i in range(len(result))]


class OnnxRuntimeEngine(Engine):
    """ONNX Runtime on the CPU: ONNX (opset 18) by the dynamo exporter, a stable sort written as `TopK`
    (`sort_as_topk`); fp32, int8 by its static quantization (QDQ)."""

    name = "onnxruntime"
    extra = "onnxruntime"
    packages = ("onnxruntime", "onnx", "onnxscript")
    precisions = ("fp32", "int8")
    graph_file = "encoder.onnx"
    matmul_types = ("MatMul", "Gemm")
    quantizer_type = "DequantizeLinear"

    @classmethod
    def export(cls, graph: EncoderGraph, example: torch.Tensor, folder: Path) -> Path:
        path = folder / cls.file_name("fp32")
        outputs = ["last_hidden_state", "token_sizes"] + (["source_map"] if graph.trace_source else [])
        torch.onnx.export(graph, (example,), str(path), dynamo=True, opset_version=18, input_names=["pixel_values"],
                          output_names=outputs, dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=1024)},),
                          custom_translation_table={torch.ops.aten.sort.stable: sort_as_topk}, verbose=False,
                          external_data=False)
        return path

    @classmethod
    def quantize(cls, path: Path, calibration: torch.Tensor, folder: Path) -> Path:
        """Static int8 (QDQ, symmetric weights per channel, activations per tensor). Left in fp32: the matching's
        products, the projections that compute its keys (`key_projection_matmuls`), the temporal attention's output
        branch and the attention's own products (`attention_product_matmuls`). The activation ranges are
        `onnx_calibration_ranges`' (`quantize_static`'s own calibration, in bounded memory)."""
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

        nodes, kinds = cls.graph_nodes(path), cls.matmul_types
        ignored = sorted(set(matching_matmuls(nodes, matmul_types=kinds))
                         | set(key_projection_matmuls(nodes, matmul_types=kinds))
                         | set(attention_output_matmuls(nodes, matmul_types=kinds, attention_types=cls.attention_types,
                                                      min_chain=2))
                         | set(attention_product_matmuls(nodes, matmul_types=kinds)))
        out = folder / cls.file_name("int8")
        samples = ({"pixel_values": video[None].numpy()} for video in calibration)  # one video at a time
        with tempfile.TemporaryDirectory(prefix="calibration-", dir=folder) as work:
            ranges = onnx_calibration_ranges(path, samples, list(kinds), Path(work))
            quantize_static(str(path), str(out), None, quant_format=QuantFormat.QDQ, op_types_to_quantize=list(kinds),
                            per_channel=True, weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
                            nodes_to_exclude=ignored, extra_options={"MatMulConstBOnly": True},
                            calibration_cache_path=ranges)
        return out

    @classmethod
    def graph_nodes(cls, path: Path) -> dict[str, tuple[str, list[str]]]:
        import onnx

        return onnx_nodes(onnx.load(str(path), load_external_data=False).graph)

    def __init__(self, path: Path, precision: str) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = torch.get_num_threads()
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, pixel_values: Any) -> list[Any]:
        return self.session.run(None, {"pixel_values": pixel_values})


ENGINES: dict[str, type[Engine]] = {engine.name: engine for engine in (OpenVINOEngine, OnnxRuntimeEngine)}
"""The engines by ``backend`` name (`runtimes.py`'s exported runtimes run one each)."""


# ----------------------------------------------------------------------------------------------------------------------
# The encoder a model runs
# ----------------------------------------------------------------------------------------------------------------------


class ExportedEncoder:
    """Stands in for a `TestaVisionModel`'s forward: runs the exported graph of the model's current settings and
    returns a `TestaVisionModelOutput` (``last_hidden_state``, ``pooler_output``, ``token_sizes``, ``source_map``).

    Graphs are exported on first use of an input shape (frames, channels, height, width) and settings, into
    ``cache_dir``, and loaded from there afterwards. The weights are fingerprinted once, here: an optimized model is
    for inference (its weights do not change).

    Args:
        vision_model: the `TestaVisionModel` (kept to export new shapes or settings).
        engine: the engine that exports, quantizes and runs it (an `Engine` class, e.g. `OpenVINOEngine`).
        precision: one of the engine's precisions (the runtime checked it).
        cache_dir: where exports are kept (default `default_cache_dir`).
        calibration: ``(videos, frames, channels, height, width)`` normalised pixel values for int8 calibration
            (default: `default_calibration_videos` at each exported shape).
    """

    def __init__(self, vision_model: nn.Module, engine: type[Engine], precision: str,
                 cache_dir: str | os.PathLike | None = None, calibration: torch.Tensor | None = None) -> None:
        self.vision_model = vision_model
        self.engine = engine
        self.precision = precision
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.calibration = calibration
        self.weights_sha256 = tensor_fingerprint(sorted(vision_model.state_dict().items()))
        self.versions = engine.versions()
        self.graphs: dict[str, Engine] = {}
        self.exports = 0  # how many graphs this encoder exported (the rest came from the cache)

    def calibration_for(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        if self.precision != "int8":
            return None
        if self.calibration is None:
            frames, channels, height, width = shape
            return default_calibration_videos(frames, height, width, channels=channels)
        if tuple(self.calibration.shape[1:]) != tuple(shape):
            raise ValueError(f"`calibration` videos have shape {tuple(self.calibration.shape[1:])} per video, but the "
                             f"encoder is called with {tuple(shape)}; give calibration videos of the shape you encode.")
        return self.calibration.float()

    def folder_for(self, shape: tuple[int, ...], trace_source: bool, precision: str | None = None
                   ) -> tuple[Path, torch.Tensor | None]:
        """The cache folder of the graph for this input shape and the model's current settings, and the
        calibration videos (int8). bf16 is the fp32 graph with its linear layers made bf16 when compiled
        (`linear_layers_in_bf16`): it shares fp32's folder."""
        self.engine.check_settings(self.vision_model)  # `set_aggregation` may have changed them since
        precision = precision or self.precision
        precision = "fp32" if precision == "bf16" else precision
        calibration = self.calibration_for(shape) if precision == "int8" else None
        calibration_sha = None if calibration is None else tensor_fingerprint([("calibration", calibration)])
        name = self.engine.name
        key = cache_key(self.weights_sha256, config_settings(self.vision_model), name, precision, shape,
                        trace_source, calibration_sha, self.versions)
        return self.cache_dir / f"{name}-{precision}-{key[:24]}", calibration

    def exported_path(self, shape: tuple[int, ...], trace_source: bool, precision: str) -> Path:
        """The graph file for ``precision`` (exported, or quantized from the fp32 export, when not cached)."""
        folder, calibration = self.folder_for(shape, trace_source, precision)
        engine = self.engine
        path, done = folder / engine.file_name(precision), folder / "done.json"
        if done.exists():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        if precision == "int8":
            fp32 = self.exported_path(shape, trace_source, "fp32")
            logger.warning("Quantizing the TESTA encoder for %s (int8, input %s); it is cached in %s.", engine.name,
                           shape, folder)
            path = engine.quantize(fp32, calibration, folder)
        else:
            logger.warning("Exporting the TESTA encoder to %s (input %s); it is cached in %s.", engine.name, shape,
                           folder)
            graph = EncoderGraph(self.vision_model, trace_source).eval()
            path = engine.export(graph, torch.zeros(2, *shape), folder)  # batch 2: the tracer would specialise 1
            self.exports += 1
        done.write_text(json.dumps({"shape": list(shape), "backend": engine.name, "precision": precision,
                                    "trace_source": trace_source, "weights_sha256": self.weights_sha256,
                                    "versions": self.versions, "platform": platform.platform()}, indent=1))
        return path

    def graph_for(self, shape: tuple[int, ...], trace_source: bool) -> Engine:
        """The loaded graph for this input shape and the model's current settings (exported when not cached)."""
        folder = self.folder_for(shape, trace_source)[0]
        if folder.name not in self.graphs:
            path = self.exported_path(shape, trace_source, self.precision)
            self.graphs[folder.name] = self.engine(path, self.precision)
        return self.graphs[folder.name]

    def __call__(self, pixel_values: torch.Tensor, trace_source: bool | None = None, return_dict: bool | None = None):
        """Runs the graph of this input shape and the model's settings; the optional outputs an export cannot give
        (hidden states, attentions) are refused by the runtime (`runtimes.ExportedRuntime`)."""
        model = self.vision_model
        config = model.config
        model.check_pixel_values(pixel_values)
        trace = bool(config.trace_source if trace_source is None else trace_source)
        shape = tuple(int(s) for s in pixel_values.shape[1:])
        graph = self.graph_for(shape, trace)
        outputs = graph(pixel_values.detach().float().cpu().contiguous().numpy())
        last_hidden_state = torch.from_numpy(outputs[0])
        output = TestaVisionModelOutput(
            last_hidden_state=last_hidden_state, pooler_output=last_hidden_state[:, 0],
            token_sizes=torch.from_numpy(outputs[1]), source_map=torch.from_numpy(outputs[2]).long() if trace else None,
        )
        return output.to_tuple() if return_dict is False else output


__all__ = [
    "ENGINES",
    "EncoderGraph",
    "Engine",
    "ExportedEncoder",
    "FOLDED_SUFFIX",
    "OnnxRuntimeEngine",
    "OpenVINOEngine",
    "attention_output_matmuls",
    "attention_product_matmuls",
    "cache_key",
    "cpu_flags",
    "cpu_has_bf16",
    "cpu_has_vnni",
    "default_cache_dir",
    "default_calibration_videos",
    "export_program",
    "fed_by",
    "first_matmuls_above",
    "fold_linear_pairs",
    "graph_code_fingerprint",
    "key_projection_matmuls",
    "library_versions",
    "linear_layers_in_bf16",
    "matching_matmuls",
    "onnx_calibration_ranges",
    "onnx_nodes",
    "openvino_core",
    "openvino_nodes",
    "sort_as_topk",
    "tensor_fingerprint",
    "walk_graph",
]
