"""The TESTA video encoder exported with its merging, run by an inference engine on the CPU: what the exported
runtimes share (`ExportedRuntime`: the export, its cache and int8 calibration, the run, the engine worker).

`optimize_for_inference(model, backend="openvino" | "onnxruntime", precision=...)` gives a model's
`TestaVisionModel` an exported runtime. **One class per engine** (`openvino_runtime.OpenVINORuntime`,
`onnxruntime_runtime.OnnxRuntimeRuntime`, as Optimum has one model class per engine) owns everything that engine
does: its name, package extra and precisions, its file names, export, int8 quantization and loading; everything else
is here, once. The whole encoder (embeddings, every block with its frame and patch matching and merging, the final
LayerNorm) is one graph, exported once per input shape (frames, height, width; the batch is dynamic) and kept on disk.

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
  fp32, as PyTorch's bf16 does: `graph_surgery.linear_layers_in_bf16` converts their inputs and weights to bf16 in
  the graph, which is compiled with the f32 hint. (OpenVINO's own bf16 hint also rounds the key similarities of the
  matching to bf16, and took none of fp32's merge decisions on the demo's videos.)
- ``"int8"``: post-training static quantization by the engine's own tools, calibrated on a few videos
  (`calibration`, default `default_calibration_videos`): NNCF (`nncf.quantize`, transformer preset) for OpenVINO,
  `onnxruntime.quantization.quantize_static` (QDQ, weights per channel) for ONNX Runtime. The matrix multiplies
  whose results decide the matching (`matching_matmuls`: the key similarities, and Eq. 1's attention for the
  importance strategy) are excluded from quantization and stay fp32, and so is the temporal attention's output
  branch (its projection and ``temporal_fc``: `attention_output_matmuls`), whose int8 error flipped merge decisions
  on repeated frames (the selections and rewrites named here are `graph_surgery`'s). For OpenVINO that branch is
  folded into one layer first (`fold_linear_pairs`: the two are linear maps in a row at inference), computed in bf16
  where the CPU has bf16 instructions: it then costs about what it cost in int8. For ONNX Runtime, whose export has
  the attention unfused and whose quantization has no SmoothQuant, the attention's own products (queries times keys,
  probabilities times values: `attention_product_matmuls`) and the projections that compute the matching's keys
  (`key_projection_matmuls`) stay fp32 too. Activation scales are static, so a video's embedding does not depend on
  the other videos of its batch. ONNX Runtime's calibration runs in bounded memory (`onnxruntime_runtime.onnx_calibration_ranges`: the
  ranges of `quantize_static`'s own calibrator, whose graph runs in the priority-based order).

**Cache.** An export is saved under ``cache_dir`` (default ``$HF_HOME/testa/engines``) in a folder named by
`cache_key`: the weights' SHA-256, the full vision config (aggregation settings included), the input shape, backend,
precision, the calibration videos' SHA-256 (int8), the library versions and the code that defines the graph
(`graph_code_fingerprint`). A change of any of them exports again; `set_aggregation` after `optimize_for_inference`
is picked up at the next call.
"""

import hashlib
import json
import logging
import platform
import sys
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from modeling_testa.aggregation import snap_scores
from modeling_testa.aggregation_block import sequence
from modeling_testa.modeling_testa_vision import TestaVisionModelOutput
from testa_runtimes.encoder_runtime import EncoderGraph, EncoderRuntime
from testa_runtimes.engine_worker import EngineProcess
from testa_runtimes.fingerprints import tensor_fingerprint


logger = logging.getLogger(__name__)

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


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



def default_cache_dir() -> Path:
    """``$HF_HOME/testa/engines`` (the Hugging Face cache home)."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "testa" / "engines"


GRAPH_CODE = ("encoder_runtime.py", "exported.py", "graph_surgery.py", "openvino_runtime.py", "onnxruntime_runtime.py")
"""The files of this package that define an exported graph: `EncoderGraph`, the export, the surgery, the engines."""


def graph_code_fingerprint() -> str:
    """SHA-256 of the source of the modules that define the exported graph (the encoder, its blocks, the matching and
    merging, the export itself): a graph exported by other code is never reused (it could merge other tokens than the
    PyTorch model does). The score grid the decisions are taken on is a setting of the config, keyed with it."""
    defining = (snap_scores, sequence, TestaVisionModelOutput)  # aggregation, aggregation_block, the vision model
    files = [Path(sys.modules[item.__module__].__file__) for item in defining]
    digest = hashlib.sha256()
    for path in files + [Path(__file__).with_name(name) for name in GRAPH_CODE]:
        digest.update(path.read_bytes())
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


def export_program(graph: EncoderGraph, example: torch.Tensor) -> Any:
    """`torch.export` of the encoder graph with a dynamic batch."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    with torch.no_grad():
        return torch.export.export(graph, (example,), dynamic_shapes=({0: batch},))



class ExportedRuntime(EncoderRuntime):
    """The encoder exported with its merging as one graph per input shape and settings, run by an engine on the CPU;
    the text modules stay PyTorch fp32. Calling it returns a `TestaVisionModelOutput` (``last_hidden_state``,
    ``pooler_output``, ``token_sizes``, ``source_map``); the optional outputs an export cannot give are refused.

    Graphs are exported on first use of an input shape (frames, channels, height, width) and settings, into
    ``cache_dir``, and loaded from there afterwards. The weights are fingerprinted once, at creation: an optimized
    model is for inference (its weights do not change). With ``isolate=True`` the engine runs in a worker process
    (`engine_worker.EngineProcess`), which holds an in-process runtime of the same class.

    A subclass is one engine: it declares ``name``, ``extra``, ``packages``, ``precisions`` (bf16 where the CPU has
    bf16 instructions: `check_model`), ``graph_file`` (the fp32 graph's file name; int8's adds ``_int8``:
    `file_name`), its graphs' node types (``matmul_types``, ``attention_types``: what the selections of
    `graph_surgery` read; ``quantizer_type``: a quantization step), and how it exports (`export`), quantizes to int8
    (`quantize`), reads (`graph_nodes`) and loads (`load_graph`) a graph. Nothing else tells the engines apart.

    Args:
        vision_model: the `TestaVisionModel` (kept to export new shapes or settings).
        precision: one of the engine's precisions (`check` checked it).
        cache_dir: where exports are kept (default `default_cache_dir`).
        calibration: ``(videos, frames, channels, height, width)`` normalised pixel values for int8 calibration
            (default: `default_calibration_videos` at each exported shape).
        isolate: run the engine in a worker process (`RuntimeOptions`).
    """

    devices = ("cpu",)
    precisions = ("fp32", "int8")
    options = ("cache_dir", "calibration", "isolate")
    outputs = ()
    exported = True
    graph_file: ClassVar[str] = ""
    matmul_types: ClassVar[tuple[str, ...]] = ("MatMul",)
    attention_types: ClassVar[tuple[str, ...]] = ()
    quantizer_type: ClassVar[str] = ""

    # -- the engine: what a subclass gives ------------------------------------------------------------------------

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

    @classmethod
    def load_graph(cls, path: Path, precision: str) -> Callable[[Any], list[Any]]:
        """The graph at ``path``, loaded to run in ``precision`` with as many threads as PyTorch uses
        (`torch.set_num_threads`, so that comparisons are like for like): ``numpy pixel_values -> numpy outputs``."""
        raise NotImplementedError

    @classmethod
    def file_name(cls, precision: str) -> str:
        """The file of the graph of ``precision`` in its cache folder (bf16 loads the fp32 file)."""
        stem, suffix = cls.graph_file.rsplit(".", 1)
        return f"{stem}_int8.{suffix}" if precision == "int8" else cls.graph_file

    @classmethod
    def check_model(cls, vision_model: nn.Module, precision: str, options: dict[str, Any],
                    backend: str | None = None) -> None:
        if precision == "bf16" and not cpu_has_bf16():
            raise ValueError(f"precision='bf16' with backend={cls.name!r} needs a CPU with bf16 instructions "
                             f"({' or '.join(BF16_FLAGS)}); this CPU has neither, and emulated bf16 is slower than "
                             "fp32. Use precision='int8' or 'fp32'.")
        calibration = options.get("calibration")
        if calibration is not None and (not isinstance(calibration, torch.Tensor) or calibration.ndim != 5):
            raise ValueError("`calibration` must be a tensor of normalised videos (videos, frames, channels, height, "
                             f"width); got {getattr(calibration, 'shape', type(calibration).__name__)}.")

    # -- one instance per model -------------------------------------------------------------------------------------

    def __init__(self, vision_model: nn.Module, precision: str, **options: Any) -> None:
        super().__init__(vision_model, precision, **options)
        self.cache_dir = Path(self.options["cache_dir"] or default_cache_dir())
        self.calibration = self.options["calibration"]
        self.process = EngineProcess(self) if self.options["isolate"] else None
        if self.process is None:  # the worker fingerprints the weights in its own runtime
            self.weights_sha256 = tensor_fingerprint(sorted(vision_model.state_dict().items()))
            self.versions = library_versions(self.packages)
        self.graphs: dict[str, Callable[[Any], list[Any]]] = {}
        self.exports = 0  # how many graphs this runtime exported (the rest came from the cache)

    def prepare(self, model: nn.Module) -> dict[str, Any]:
        return {"isolate": bool(self.options["isolate"])}

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
        """The cache folder of the graph for this input shape and the model's current settings (`set_aggregation`
        may have changed them since), and the calibration videos (int8). bf16 is the fp32 graph with its linear
        layers made bf16 when loaded (`graph_surgery.linear_layers_in_bf16`): it shares fp32's folder."""
        precision = precision or self.precision
        precision = "fp32" if precision == "bf16" else precision
        calibration = self.calibration_for(shape) if precision == "int8" else None
        calibration_sha = None if calibration is None else tensor_fingerprint([("calibration", calibration)])
        key = cache_key(self.weights_sha256, config_settings(self.vision_model), self.name, precision, shape,
                        trace_source, calibration_sha, self.versions)
        return self.cache_dir / f"{self.name}-{precision}-{key[:24]}", calibration

    def exported_path(self, shape: tuple[int, ...], trace_source: bool, precision: str) -> Path:
        """The graph file for ``precision`` (exported, or quantized from the fp32 export, when not cached)."""
        folder, calibration = self.folder_for(shape, trace_source, precision)
        path, done = folder / self.file_name(precision), folder / "done.json"
        if done.exists():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        if precision == "int8":
            fp32 = self.exported_path(shape, trace_source, "fp32")
            logger.warning("Quantizing the TESTA encoder for %s (int8, input %s); it is cached in %s.", self.name,
                           shape, folder)
            path = self.quantize(fp32, calibration, folder)
        else:
            logger.warning("Exporting the TESTA encoder to %s (input %s); it is cached in %s.", self.name, shape,
                           folder)
            graph = EncoderGraph(self.vision_model, trace_source).eval()
            path = self.export(graph, torch.zeros(2, *shape), folder)  # batch 2: the tracer would specialise 1
            self.exports += 1
        done.write_text(json.dumps({"shape": list(shape), "backend": self.name, "precision": precision,
                                    "trace_source": trace_source, "weights_sha256": self.weights_sha256,
                                    "versions": self.versions, "platform": platform.platform()}, indent=1))
        return path

    def graph_for(self, shape: tuple[int, ...], trace_source: bool) -> Callable[[Any], list[Any]]:
        """The loaded graph for this input shape and the model's current settings (exported when not cached)."""
        folder = self.folder_for(shape, trace_source)[0]
        if folder.name not in self.graphs:
            self.graphs[folder.name] = self.load_graph(self.exported_path(shape, trace_source, self.precision),
                                                       self.precision)
        return self.graphs[folder.name]

    def encode(self, pixel_values: torch.Tensor, trace_source: bool | None = None) -> TestaVisionModelOutput:
        """Runs the graph of this input shape and the model's settings, in this process."""
        model = self.vision_model
        model.check_pixel_values(pixel_values)
        trace = bool(model.config.trace_source if trace_source is None else trace_source)
        graph = self.graph_for(tuple(int(s) for s in pixel_values.shape[1:]), trace)
        outputs = graph(pixel_values.detach().float().cpu().contiguous().numpy())
        last_hidden_state = torch.from_numpy(outputs[0])
        return TestaVisionModelOutput(
            last_hidden_state=last_hidden_state, pooler_output=last_hidden_state[:, 0],
            token_sizes=torch.from_numpy(outputs[1]), source_map=torch.from_numpy(outputs[2]).long() if trace else None,
        )

    def __call__(self, pixel_values, output_hidden_states=False, output_attentions=False, trace_source=None):
        self.unavailable_outputs(output_hidden_states, output_attentions)  # refused
        if self.process is None:
            return self.encode(pixel_values, trace_source)
        return self.process.encode(pixel_values, trace_source)


__all__ = ["BF16_FLAGS", "GRAPH_CODE", "ExportedRuntime", "cache_key", "config_settings", "cpu_flags", "cpu_has_bf16",
           "default_cache_dir", "default_calibration_videos", "export_program", "graph_code_fingerprint",
           "library_versions"]
