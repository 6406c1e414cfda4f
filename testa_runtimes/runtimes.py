"""The runtimes of the TESTA video encoder: one class per way of running it, all with one interface (as Optimum has
one model class per engine).

`optimize_for_inference(model, precision, backend=NAME)` picks a runtime by name from `RUNTIMES`, checks that it can
run this model in one place (`EncoderRuntime.check`), prepares the model (`EncoderRuntime.prepare`) and stores the
runtime in the vision model's ``runtime`` attribute; `TestaVisionModel.forward` then hands every call to it (nothing
is monkeypatched: a model whose ``runtime`` is ``None`` runs its own eager forward).

=================  ============================  ===========  ==========================  ===========================
name               class                         devices      precisions                  cannot give
=================  ============================  ===========  ==========================  ===========================
``"torch"``        picks by device: `CudaGraphRuntime` on CUDA (unless ``compile=True``), `TorchEagerRuntime` elsewhere
``"torch-eager"``  `TorchEagerRuntime`           any          fp32, bf16, int8 (CPU;      (everything is given)
                                                              legacy, deprecated)
``"cuda-graphs"``  `CudaGraphRuntime`            cuda         fp32, bf16                  runs eager instead (logged):
                                                                                          hidden states, attentions,
                                                                                          autograd, new shapes
``"openvino"``     `OpenVINORuntime`             cpu          fp32, bf16 (CPUs with bf16  hidden states, attentions
                                                              instructions), int8         (refused)
``"onnxruntime"``  `OnnxRuntimeRuntime`          cpu          fp32, int8                  hidden states, attentions
                                                                                          (refused)
=================  ============================  ===========  ==========================  ===========================

Each class declares what it cannot do as class attributes (``devices``, ``precisions``, ``options``, ``outputs``,
``packages``), and `EncoderRuntime.check` turns them into one error naming the runtime, the option and the allowed
values. An exported runtime takes its name, precisions and packages from its engine (`engines.Engine`, one class per
engine). The options themselves are declared once, in `RuntimeOptions`. ``precision="auto"`` asks the runtime
(`EncoderRuntime.auto_precision`): int8 on the CPU, bf16 on CUDA.

**CUDA graphs** (`CudaGraphRuntime`). The token counts after every merge are fixed by the settings and the input
shape, so the whole encoder (embeddings, every block with its matching and merging, the final LayerNorm) can be
captured once per input shape and replayed: one launch instead of the hundreds of kernel launches an eager forward
makes (on CUDA each matching and its merge are two fused kernels, `fused_aggregation`, which a graph captures like
any other). A shape runs eager the first time it is seen (the warm-up that capture needs; a one-off shape, such as
the last partial batch of a folder, costs no capture), and is captured the next time. Where a graph cannot serve a
call, the call runs eager and the reason is logged once per shape: hidden states or attentions requested (the graph
returns the last hidden state, the token sizes and the source map), autograd on, or ``max_graphs`` shapes already
captured.

This file is Hub remote code (the pipelines import `inference`, which imports it): flat relative imports only.
"""

import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from modeling_testa.aggregation_settings import AGGREGATION_FIELDS
from modeling_testa.fused_aggregation import check_option as check_fused_kernels_option
from testa_runtimes.linear_layers import compile_blocks, convert_linears
from testa_runtimes.engines import EncoderGraph, Engine, ExportedEncoder, OnnxRuntimeEngine, OpenVINOEngine
from modeling_testa.worker_process import WorkerProcess, exit_with_parent, read_message, signal_name, write_message
from modeling_testa.worker_process import serve as serve_requests


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeOptions:
    """The optional arguments of `optimize_for_inference`, declared once: their names, types and defaults. A runtime
    takes those in its ``options``; one left at its default is never refused (`EncoderRuntime.check`).

    Attributes:
        compile: `torch.compile` every encoder block (weights frozen; eager runtime). The first forward of each input
            shape compiles (minutes for ViT-B on a small CPU); skipped with a warning when no C++ compiler is found.
        include_text: also convert the linear layers of the text encoder/decoder (PyTorch runtimes).
        cache_dir: where exported graphs are kept (default ``$HF_HOME/testa/engines``); exported runtimes.
        calibration: ``(videos, frames, channels, height, width)`` normalised pixel values that calibrate int8 for the
            exported runtimes (a few videos of the target domain; default: synthetic videos,
            `engines.default_calibration_videos`).
        isolate: run the engine of an exported runtime in a worker process of its own (`EngineProcess`): a native
            crash of the engine then raises `EngineProcessError` in the caller instead of killing it, and the next
            call starts a new worker. For processes that live long (the app and `train.index` do it by default); a
            call costs the pipe transfer of its pixels.
        fused_kernels: when the merges run as fused GPU kernels (PyTorch runtimes): ``"auto"`` (on CUDA at
            inference, once checked on the device), ``"off"`` (PyTorch ops) or ``"interpret"`` (Triton's interpreter,
            CPU tensors too: tests and kernel counts); `fused_aggregation.FUSED_KERNELS`.
    """

    compile: bool = False
    include_text: bool = False
    cache_dir: str | os.PathLike | None = None
    calibration: torch.Tensor | None = None
    isolate: bool = False
    fused_kernels: str = "auto"

    @classmethod
    def of(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Every option, ``options`` over the defaults, as a dict; raises `ValueError` naming an unknown option (and
        the allowed ones) or a bad ``fused_kernels``."""
        unknown = sorted(set(options) - set(OPTION_DEFAULTS))
        if unknown:
            raise ValueError(f"{', '.join(f'`{n}`' for n in unknown)}: not an option of optimize_for_inference; its "
                             f"options are {', '.join(f'`{n}`' for n in OPTION_DEFAULTS)} (runtimes.RuntimeOptions).")
        complete = {**OPTION_DEFAULTS, **options}
        check_fused_kernels_option(complete["fused_kernels"])
        return complete


OPTION_DEFAULTS: dict[str, Any] = {option.name: option.default for option in fields(RuntimeOptions)}
"""`RuntimeOptions`' defaults by name."""

INT8_DEPRECATION = (
    "optimize_for_inference(precision='int8', backend='torch') uses PyTorch's legacy quantized kernels "
    "(torch.ops.quantized.linear_prepack / linear_dynamic), whose eager quantization workflow PyTorch has deprecated; "
    "it will be removed when PyTorch removes them. backend='openvino' gives int8 on a maintained engine (and is "
    "faster: docs/inference.md)."
)
"""The warning of the legacy torch int8 path."""


def is_default(name: str, value: Any) -> bool:
    """Whether ``value`` is the default of option ``name`` (`OPTION_DEFAULTS`; a tensor never is)."""
    default = OPTION_DEFAULTS[name]
    return value is default or (not isinstance(value, torch.Tensor) and value == default)


def _quoted(values) -> str:
    return ", ".join(map(repr, values))


def device_type(vision_model: nn.Module) -> str:
    """The device type the vision model's weights are on (what picks and checks a runtime)."""
    return next(vision_model.parameters()).device.type


class EncoderRuntime:
    """What runs a `TestaVisionModel`'s forward after `optimize_for_inference`.

    A subclass declares, as class attributes, what it can do; `check` refuses everything else, once, naming the
    runtime, the option and the allowed values. An instance is created for one vision model and precision,
    `prepare` converts the model in place, and calling it runs one forward.

    Class attributes:
        name: the name `optimize_for_inference(backend=...)` knows it by.
        devices: the device types it runs on (``None``: any).
        precisions: the precisions it offers (int8 on the CPU only: every int8 kernel here is a CPU kernel).
        options: the optional arguments of `optimize_for_inference` it takes (`RuntimeOptions`).
        outputs: the optional outputs it can give (``output_hidden_states``, ``output_attentions``).
        falls_back: whether the optional outputs it cannot give run eager instead (``True``) or are refused.
        exported: whether it runs an exported graph (other kernels than PyTorch's: other embeddings, to rounding).
        packages, extra: the Python packages it needs, and the package extra that installs them.
    """

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...] | None] = ("cpu",)
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    options: ClassVar[tuple[str, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ("output_hidden_states", "output_attentions")
    falls_back: ClassVar[bool] = False
    exported: ClassVar[bool] = False
    packages: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str | None] = None

    # -- what it can do ---------------------------------------------------------------------------------------------

    @classmethod
    def auto_precision(cls, device: str) -> str:
        """The rule behind ``precision="auto"``: the fastest precision within the quality contract, as measured by
        `benchmarks/fast_inference.py` (docs/inference.md): int8 on the CPU (OpenVINO int8 was the fastest variant
        within the contract on AVX-512 VNNI, and PyTorch's int8 beat its bf16 and fp32 with and without VNNI);
        bf16 on a GPU."""
        preferred = ("int8", "bf16", "fp32") if device == "cpu" else ("bf16", "fp32")
        return next(p for p in preferred if p in cls.allowed_precisions(device))

    @classmethod
    def allowed_precisions(cls, device: str) -> tuple[str, ...]:
        return tuple(p for p in cls.precisions if p != "int8" or device == "cpu")

    @classmethod
    def label(cls, backend: str | None = None) -> str:
        """How messages name the runtime: ``backend='torch' (runtime 'cuda-graphs')`` when picked by another name."""
        if backend is None or backend == cls.name:
            return f"backend={cls.name!r}"
        return f"backend={backend!r} (runtime {cls.name!r})"

    @classmethod
    def require_packages(cls) -> None:
        """Raises `ImportError` naming the extra to install when a package the runtime needs is missing."""
        for module in cls.packages:
            try:
                __import__(module)
            except ImportError as error:
                raise ImportError(
                    f"backend={cls.name!r} needs the `{module}` package, which is not installed: "
                    f'pip install "testa-hf[{cls.extra}]" (or, from a clone, pip install ".[{cls.extra}]").'
                ) from error

    @classmethod
    def check_precision(cls, precision: str, device: str = "cpu", backend: str | None = None) -> None:
        """Raises `ValueError` for a precision the runtime does not offer on ``device``."""
        if precision not in cls.precisions:
            raise ValueError(f"precision={precision!r} is not offered by {cls.label(backend)}; allowed values are "
                             f"{_quoted(cls.precisions)} (and 'auto').")
        if precision not in cls.allowed_precisions(device):
            raise ValueError(f"precision={precision!r} runs on the CPU only (int8 kernels are CPU kernels); the model "
                             f"is on {device}. Allowed values of {cls.label(backend)} there are "
                             f"{_quoted(cls.allowed_precisions(device))}; use precision='bf16' on GPUs.")

    @classmethod
    def check(cls, vision_model: nn.Module, precision: str, options: dict[str, Any],
              backend: str | None = None) -> None:
        """Every refusal of this runtime, in one place: the device, the precision, the options (`ValueError`,
        naming the allowed values), missing packages (`ImportError`, naming the extra) and the model's settings.
        ``backend``: the name the caller used, for the messages."""
        device = device_type(vision_model)
        if cls.devices is not None and device not in cls.devices:
            raise ValueError(f"{cls.label(backend)} runs on {' or '.join(cls.devices)}; the model is on {device}. "
                             f"Backends for {device}: {_quoted(names_for_device(device))}.")
        cls.check_precision(precision, device, backend)
        options = RuntimeOptions.of(options)
        given = [name for name, value in options.items() if not is_default(name, value)]
        refused = [name for name in given if name not in cls.options]
        if refused:
            takers = [n for n, c in RUNTIMES.items() if set(refused) <= set(c.options)]
            verb = "is not an option" if len(refused) == 1 else "are not options"
            raise ValueError(
                f"{' and '.join(f'`{n}`' for n in refused)} {verb} of {cls.label(backend)} (its options: {', '.join(f'`{o}`' for o in cls.options) or 'none'}); "
                f"{'backends that take it: ' + _quoted(takers) if takers else 'no backend takes them together'}."
            )
        cls.require_packages()
        cls.check_model(vision_model, precision, options, backend)

    @classmethod
    def check_model(cls, vision_model: nn.Module, precision: str, options: dict[str, Any],
                    backend: str | None = None) -> None:
        """What a subclass refuses beyond the declared attributes (settings, CPU instructions)."""

    # -- one instance per model -------------------------------------------------------------------------------------

    def __init__(self, vision_model: nn.Module, precision: str, **options: Any) -> None:
        self.vision_model = vision_model
        self.precision = precision
        self.options = RuntimeOptions.of(options)

    def prepare(self, model: nn.Module) -> dict[str, Any]:
        """Converts ``model`` (the vision model or the head holding it) in place; returns what to record in its
        ``inference_settings``."""
        return {}

    def unavailable_outputs(self, output_hidden_states: bool, output_attentions: bool) -> list[str]:
        """The optional outputs requested that this runtime cannot give: refused (`ValueError`), or, where the
        runtime ``falls_back``, returned (the call then runs eager)."""
        requested = {"output_hidden_states": output_hidden_states, "output_attentions": output_attentions}
        unavailable = [name for name, wanted in requested.items() if wanted and name not in self.outputs]
        if unavailable and not self.falls_back:
            raise ValueError(f"{unavailable[0]}=True is not available from backend={self.name!r}: it returns the last "
                             "hidden state, the token sizes and the source map. Use backend='torch' for it.")
        return unavailable

    def __call__(self, pixel_values: torch.Tensor, output_hidden_states: bool = False,
                 output_attentions: bool = False, trace_source: bool | None = None):
        """One forward; returns a `TestaVisionModelOutput`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.name!r}, precision={self.precision!r})"


# ----------------------------------------------------------------------------------------------------------------------
# PyTorch eager
# ----------------------------------------------------------------------------------------------------------------------


COMPILED_IMPORTANCE_REFUSAL = (
    "compile=True with aggregation_strategy='importance' (merging) is refused: TorchInductor (torch 2.14.1, CPU) "
    "compiles the importance strategy's merges wrongly when a block merges on both axes (a tiny encoder: last hidden "
    "state cosine about 0.3 against eager, in fp32 and bf16, a silent wrong answer; the cause is not found). Run it "
    "without compile, or compile the geometry strategy (or importance with reduction_mode='prune'), which equal eager."
)


def compiles_wrongly(vision_model: nn.Module) -> bool:
    """Whether the vision model's aggregation settings are ones TorchInductor is known to compile wrongly."""
    settings = vision_model.aggregation_settings()
    return settings.aggregation_strategy == "importance" and settings.reduction_mode == "merge"


class TorchEagerRuntime(EncoderRuntime):
    """PyTorch eager: the model's own forward, with its linear layers converted for the precision
    (`linear_layers.convert_linears`: bf16, or the legacy int8 kernels, CPU only), and ``compile=True``: every encoder
    block compiled by `torch.compile` (TorchInductor, weights frozen)."""

    name = "torch-eager"
    devices = None
    precisions = ("fp32", "bf16", "int8")
    options = ("compile", "include_text", "fused_kernels")

    @classmethod
    def check_model(cls, vision_model: nn.Module, precision: str, options: dict[str, Any],
                    backend: str | None = None) -> None:
        if options.get("compile") and compiles_wrongly(vision_model):
            raise ValueError(COMPILED_IMPORTANCE_REFUSAL)

    def prepare(self, model: nn.Module) -> dict[str, Any]:
        if self.precision == "int8":
            warnings.warn(INT8_DEPRECATION, FutureWarning, stacklevel=3)  # the caller of optimize_for_inference
        converted = convert_linears(model, self.vision_model, self.precision, self.options["include_text"])
        self.compiled = compile_blocks(self.vision_model) if self.options["compile"] else False
        return {"compile": self.compiled, "include_text": self.options["include_text"],
                "converted_linears": converted}

    def __call__(self, pixel_values, output_hidden_states=False, output_attentions=False, trace_source=None):
        if getattr(self, "compiled", False) and compiles_wrongly(self.vision_model):  # set_aggregation since
            raise ValueError(COMPILED_IMPORTANCE_REFUSAL)
        return self.vision_model.eager_forward(pixel_values, output_hidden_states, output_attentions, trace_source,
                                               self.options["fused_kernels"])


# ----------------------------------------------------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------------------------------------------------


class CudaGraphCapture:
    """Captures ``function(static_input)`` as a CUDA graph: a warm-up on a side stream (as capture requires), then the
    capture. Returns ``(replay, static_outputs)``: ``replay()`` re-runs the captured kernels on whatever
    ``static_input`` holds and leaves the results in ``static_outputs``."""

    def __call__(self, function: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], static_input: torch.Tensor
                 ) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
        with torch.cuda.device(static_input.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                function(static_input)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_outputs = function(static_input)
        return graph.replay, static_outputs


class CudaGraphRuntime(EncoderRuntime):
    """The encoder captured as a CUDA graph per input shape and replayed (see the module docstring): the GPU path
    without kernel-launch overhead. The linear layers are converted as `TorchEagerRuntime` converts them (bf16), and a
    graph replays the kernels the eager forward launched while it was captured, so its outputs should equal eager's
    (checked on the CPU with a stand-in capture; not yet on a GPU).

    Args:
        vision_model, precision: as for every runtime.
        max_graphs (`int`, defaults to 8): how many input shapes are captured (each graph keeps its own memory);
            further shapes run eager.
        warmup_calls (`int`, defaults to 1): how many times a shape runs eager before it is captured.
        capture: what captures a graph (`CudaGraphCapture`; tests on the CPU pass another).
    """

    name = "cuda-graphs"
    devices = ("cuda",)
    precisions = ("fp32", "bf16")
    options = ("include_text", "fused_kernels")
    outputs = ()
    falls_back = True

    def __init__(self, vision_model: nn.Module, precision: str, max_graphs: int = 8, warmup_calls: int = 1,
                 capture: Callable | None = None, **options: Any) -> None:
        super().__init__(vision_model, precision, **options)
        self.max_graphs = max_graphs
        self.warmup_calls = warmup_calls
        self.capture = capture if capture is not None else CudaGraphCapture()
        self.graphs: dict[tuple, tuple[torch.Tensor, Callable[[], None], tuple[torch.Tensor, ...]]] = {}
        self.calls: dict[tuple, int] = {}  # eager calls per shape, before its capture
        self.logged: set[tuple] = set()
        self.replays = 0
        self.lock = threading.Lock()  # a graph's static buffers serve one call at a time

    def prepare(self, model: nn.Module) -> dict[str, Any]:
        converted = convert_linears(model, self.vision_model, self.precision, self.options["include_text"])
        return {"include_text": self.options["include_text"], "converted_linears": converted,
                "max_graphs": self.max_graphs}

    def key(self, pixel_values: torch.Tensor, trace_source: bool) -> tuple:
        """What a graph is specific to: the input's shape, dtype and device, source tracing, and the model's
        aggregation settings, its score grid included (`set_aggregation` after `optimize_for_inference` gives other
        token counts or other decisions: another graph). The merge's kernels are this runtime's own option, fixed
        for its life."""
        settings = self.vision_model.aggregation_settings(trace_source)
        return (tuple(pixel_values.shape), pixel_values.dtype, str(pixel_values.device), repr(settings))

    def fallback_reason(self, key: tuple, output_hidden_states: bool, output_attentions: bool) -> str | None:
        """Why this call runs eager, or ``None`` when a graph serves it."""
        unavailable = self.unavailable_outputs(output_hidden_states, output_attentions)
        if unavailable:
            return (f"{' and '.join(f'{n}=True' for n in unavailable)}: a captured graph returns the last hidden "
                    "state, the token sizes and the source map only")
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.vision_model.parameters()):
            return "autograd is on (a captured graph is for inference: call it under torch.no_grad())"
        if key in self.graphs:
            return None
        if self.calls.get(key, 0) < self.warmup_calls:
            return "a shape not seen before (it runs eager once, as a warm-up, and is captured if it comes again)"
        if len(self.graphs) >= self.max_graphs:
            return f"{self.max_graphs} shapes are captured already (max_graphs): further shapes run eager"
        return None

    def log_fallback(self, key: tuple, reason: str) -> None:
        if (key, reason) not in self.logged:
            self.logged.add((key, reason))
            logger.info("cuda-graphs: input %s runs eager: %s.", key[0], reason)

    def graph_function(self, trace_source: bool) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        """``pixel_values -> (last_hidden_state, token_sizes[, source_map])``: what is captured."""
        graph = EncoderGraph(self.vision_model, trace_source, self.options["fused_kernels"])

        def function(pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                return graph(pixel_values)

        return function

    def replay(self, key: tuple, pixel_values: torch.Tensor, trace_source: bool) -> tuple[torch.Tensor, ...]:
        """Copies the input into the graph's static input, replays, and returns copies of the static outputs (the
        next replay overwrites them)."""
        with self.lock:
            if key not in self.graphs:
                with torch.inference_mode(False):  # a normal tensor: later calls may come outside inference mode
                    static_input = pixel_values.detach().clone()
                replay, static_outputs = self.capture(self.graph_function(trace_source), static_input)
                self.graphs[key] = (static_input, replay, static_outputs)
                logger.info("cuda-graphs: captured input %s (%d of at most %d graphs).", key[0], len(self.graphs),
                            self.max_graphs)
            static_input, replay, static_outputs = self.graphs[key]
            static_input.copy_(pixel_values)
            replay()
            self.replays += 1
            return tuple(output.clone() for output in static_outputs)

    def __call__(self, pixel_values, output_hidden_states=False, output_attentions=False, trace_source=None):
        from modeling_testa.modeling_testa_vision import TestaVisionModelOutput

        model = self.vision_model
        model.check_pixel_values(pixel_values)
        trace = bool(model.config.trace_source if trace_source is None else trace_source)
        key = self.key(pixel_values, trace)
        reason = self.fallback_reason(key, output_hidden_states, output_attentions)
        if reason is not None:
            self.log_fallback(key, reason)
            self.calls[key] = self.calls.get(key, 0) + 1
            return model.eager_forward(pixel_values, output_hidden_states, output_attentions, trace_source,
                                       self.options["fused_kernels"])
        outputs = self.replay(key, pixel_values, trace)
        last_hidden_state = outputs[0]
        return TestaVisionModelOutput(last_hidden_state=last_hidden_state, pooler_output=last_hidden_state[:, 0],
                                      token_sizes=outputs[1], source_map=outputs[2] if trace else None)


# ----------------------------------------------------------------------------------------------------------------------
# Exported encoders
# ----------------------------------------------------------------------------------------------------------------------


class ExportedRuntime(EncoderRuntime):
    """The encoder exported with its merging as one graph per input shape, run by an engine on the CPU
    (`engines.ExportedEncoder`: export, int8 quantization, the cache). The text modules stay PyTorch fp32. A subclass
    names its ``engine`` (an `engines.Engine`), which declares the name, precisions, extra and packages: the
    runtime takes them from it."""

    engine: ClassVar[type[Engine]]
    devices = ("cpu",)
    options = ("cache_dir", "calibration", "isolate")
    outputs = ()
    exported = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        engine = cls.__dict__.get("engine")
        if engine is not None:  # declared once, by the engine
            cls.name, cls.precisions, cls.extra, cls.packages = engine.name, engine.precisions, engine.extra, \
                engine.packages

    @classmethod
    def check_model(cls, vision_model: nn.Module, precision: str, options: dict[str, Any],
                    backend: str | None = None) -> None:
        cls.engine.check_precision(precision)
        calibration = options.get("calibration")
        if calibration is not None and (not isinstance(calibration, torch.Tensor) or calibration.ndim != 5):
            raise ValueError("`calibration` must be a tensor of normalised videos (videos, frames, channels, height, "
                             f"width); got {getattr(calibration, 'shape', type(calibration).__name__)}.")
        cls.engine.check_settings(vision_model)

    def __init__(self, vision_model: nn.Module, precision: str, **options: Any) -> None:
        super().__init__(vision_model, precision, **options)
        self.process = EngineProcess(self) if self.options["isolate"] else None
        self.encoder = None if self.process else ExportedEncoder(
            vision_model, self.engine, precision, cache_dir=self.options["cache_dir"],
            calibration=self.options["calibration"])

    def prepare(self, model: nn.Module) -> dict[str, Any]:
        return {"isolate": bool(self.options["isolate"])}

    def __call__(self, pixel_values, output_hidden_states=False, output_attentions=False, trace_source=None):
        self.unavailable_outputs(output_hidden_states, output_attentions)  # refused
        if self.process is None:
            return self.encoder(pixel_values, trace_source=trace_source)
        return self.process.encode(pixel_values, trace_source)


class OpenVINORuntime(ExportedRuntime):
    """OpenVINO on the CPU: fp32, bf16 (CPUs with AVX-512 BF16 or AMX), int8 by NNCF (`engines.OpenVINOEngine`)."""

    engine = OpenVINOEngine


class OnnxRuntimeRuntime(ExportedRuntime):
    """ONNX Runtime on the CPU: fp32, int8 by its static quantization (`engines.OnnxRuntimeEngine`)."""

    engine = OnnxRuntimeEngine


# ----------------------------------------------------------------------------------------------------------------------
# An engine in a process of its own
# ----------------------------------------------------------------------------------------------------------------------
#
# With ``isolate=True`` an exported runtime runs its engine (export, quantization, compilation, inference) in a worker
# process: ``python -c`` importing this package's `runtimes` and calling `serve`, which talks to the caller over pipes
# with length-prefixed pickles (`worker_process`, the kit the decoder's helper process runs on too). A native crash of
# the engine then kills the worker only: the caller gets an `EngineProcessError` naming the signal and the worker's
# log, and the next call starts a new worker. The app and `train.index` run exported engines this way by default.


class EngineProcessError(RuntimeError):
    """The engine's worker process died or could not start."""


def _package_root() -> str:
    """The folder holding this package (or the Hub code folder's top-level package): what the worker imports from."""
    depth = len(__package__.split("."))
    return os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * depth))


_WORKER_CODE = "import importlib, sys; sys.path.insert(0, sys.argv[1]); importlib.import_module(sys.argv[2]).serve()"
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "ImportError": ImportError, "OSError": OSError}


class EngineProcess(WorkerProcess):
    """The caller's side of one engine worker (see above; the process itself is `worker_process.WorkerProcess`'s).
    Thread-safe (one call at a time); started at the first call, after a crash, and anew in a forked child."""

    LOG_TAIL = 2000

    def __init__(self, runtime: "ExportedRuntime") -> None:
        super().__init__([sys.executable, "-c", _WORKER_CODE, _package_root(), __name__], grace=10.0)
        self.runtime = runtime
        self.lock = threading.Lock()

    def init_message(self) -> dict[str, Any]:
        vision = self.runtime.vision_model
        return {"backend": self.runtime.name, "precision": self.runtime.precision,
                "config": vision.config.to_dict(), "state_dict": {k: v.detach().cpu() for k, v in
                                                                   vision.state_dict().items()},
                "cache_dir": self.runtime.options["cache_dir"], "calibration": self.runtime.options["calibration"],
                "threads": torch.get_num_threads()}

    def start_engine(self) -> None:
        try:
            self.start()
        except (EOFError, OSError, TimeoutError) as error:
            raise self.died("starting") from error
        reply = self.request(("init", self.init_message()), "starting")
        if reply[0] != "ready":
            raise EngineProcessError(f"the {self.runtime.name} worker did not start: {reply}")

    def log_tail(self) -> str:
        return self.log_since(max_chars=self.LOG_TAIL).strip()

    def died(self, doing: str) -> EngineProcessError:
        code = self.exit_code(timeout=10)
        tail = self.log_tail()
        self.stop()
        how = f"killed by {signal_name(code)}" if signal_name(code) else (
            f"exit code {code}" if code is not None else "stopped answering")
        return EngineProcessError(
            f"The {self.runtime.name} engine's worker process died while {doing} ({how}); this process is unharmed, "
            "and the next call starts a new worker." + (f" The worker's log ends with: {tail}" if tail else ""))

    def request(self, message: tuple, doing: str) -> tuple:
        try:
            write_message(self.process.stdin.fileno(), message)
            reply = read_message(self.process.stdout.fileno())
        except (EOFError, BrokenPipeError, OSError) as error:
            raise self.died(doing) from error
        if reply[0] == "error":
            raise _ERRORS.get(reply[1], RuntimeError)(reply[2])
        return reply

    def encode(self, pixel_values: torch.Tensor, trace_source: bool | None):
        from modeling_testa.modeling_testa_vision import TestaVisionModelOutput

        vision = self.runtime.vision_model
        vision.check_pixel_values(pixel_values)
        trace = bool(vision.config.trace_source if trace_source is None else trace_source)
        settings = {name: getattr(vision.config, name) for name in AGGREGATION_FIELDS if hasattr(vision.config, name)}
        with self.lock:
            if not self.running():  # not started, died between calls (said, and replaced), or a forked child's
                if self.process is not None:
                    logger.warning("%s", self.died("idle"))
                self.start_engine()
            batch = pixel_values.detach().float().cpu().contiguous()
            reply = self.request(("encode", batch, trace, settings), f"encoding a batch of shape {tuple(batch.shape)}")
        last_hidden_state, token_sizes, source_map = reply[1]
        return TestaVisionModelOutput(last_hidden_state=last_hidden_state, pooler_output=last_hidden_state[:, 0],
                                      token_sizes=token_sizes, source_map=source_map)


def _worker_runtime(init: dict[str, Any]) -> "ExportedRuntime":
    from modeling_testa.configuration_testa import TestaVisionConfig
    from modeling_testa.modeling_testa_vision import TestaVisionModel

    torch.set_num_threads(init["threads"])  # the engines use as many threads as PyTorch does in the caller
    vision = TestaVisionModel(TestaVisionConfig(**init["config"])).eval()
    vision.load_state_dict(init["state_dict"])
    return RUNTIMES[init["backend"]](vision, init["precision"], cache_dir=init["cache_dir"],
                                     calibration=init["calibration"])


class EngineRequests:
    """The worker's request handler: ``("init", settings)`` -> ``("ready",)``; ``("encode", pixel_values,
    trace_source, aggregation settings)`` -> ``("ok", (last_hidden_state, token_sizes, source_map))``."""

    def __init__(self) -> None:
        self.runtime = None

    def __call__(self, message: tuple, replies: Any) -> None:
        if message[0] == "init":
            self.runtime = _worker_runtime(message[1])
            replies.send(("ready",))
            return
        _, pixel_values, trace, settings = message
        vision = self.runtime.vision_model
        changed = {k: v for k, v in settings.items() if getattr(vision.config, k) != v}
        if changed:
            vision.set_aggregation(**changed)
        with torch.no_grad():
            out = self.runtime.encoder(pixel_values, trace_source=trace)
        replies.send(("ok", (out.last_hidden_state, out.token_sizes, out.source_map)))


def serve() -> None:
    """The worker's loop (`worker_process.serve` with `EngineRequests`); errors are sent as ``("error", type name,
    message, code)``. Returns at the end of its input (the caller closed the pipe or exited); killed with its caller
    if an engine call hangs meanwhile."""
    exit_with_parent()
    serve_requests(EngineRequests())


# ----------------------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------------------


RUNTIMES: dict[str, type[EncoderRuntime]] = {
    runtime.name: runtime for runtime in (TorchEagerRuntime, CudaGraphRuntime, OpenVINORuntime, OnnxRuntimeRuntime)
}
"""The runtimes by name (the exported ones by their engine's name, `engines.ENGINES`)."""

BACKENDS = ("torch", "openvino", "onnxruntime", "torch-eager", "cuda-graphs")
"""The values `optimize_for_inference(backend=...)` accepts: the runtimes' names, and ``"torch"`` (`resolve`)."""


def resolve(backend: str, device: str, compile: bool = False) -> type[EncoderRuntime]:
    """The runtime class for ``backend`` on a model on ``device``: ``"torch"`` is CUDA graphs on CUDA (eager with
    ``compile=True``, which compiles the blocks instead) and eager elsewhere; every other name is its class."""
    if backend == "torch":
        return CudaGraphRuntime if device == "cuda" and not compile else TorchEagerRuntime
    if backend not in RUNTIMES:
        raise ValueError(f"backend={backend!r} is not supported; allowed values are {_quoted(BACKENDS)}.")
    return RUNTIMES[backend]


def choose(backend: str, precision: str, vision_model: nn.Module, compile: bool = False
           ) -> tuple[type[EncoderRuntime], str]:
    """The runtime class and the precision for ``backend`` and ``precision`` (``"auto"`` resolved, and logged) on
    the vision model's device: what `optimize_for_inference` runs with."""
    device = device_type(vision_model)
    runtime = resolve(backend, device, compile)
    if precision == "auto":
        precision = runtime.auto_precision(device)
        logger.info("precision='auto', backend=%r: %s on %s (runtime %r).", backend, precision, device, runtime.name)
    return runtime, precision


def names_for_device(device: str) -> list[str]:
    """The backends that run on a device type."""
    return ["torch"] + [name for name, cls in RUNTIMES.items() if cls.devices is None or device in cls.devices]


def auto_precision(backend: str, device: str = "cpu") -> str:
    """``precision="auto"`` for ``backend`` on ``device`` (`EncoderRuntime.auto_precision`)."""
    return resolve(backend, device).auto_precision(device)


def isolated_by_default(backend: str, device: str = "cpu") -> bool:
    """What long-lived callers (the app, `train.index`) pass as ``isolate``: ``True`` for the runtimes that can run
    their engine in a worker process (the exported ones)."""
    return "isolate" in resolve(backend, device).options


def embeddings_label(backend: str, precision: str, device: str = "cpu") -> str:
    """What a store or index records about how its embeddings were computed: the precision, and the engine when an
    exported graph computed them (``"int8 (openvino)"``); the PyTorch runtimes (eager, CUDA graphs) run the same
    kernels, so they record the precision alone."""
    runtime = resolve(backend, device)
    return f"{precision} ({runtime.name})" if runtime.exported else precision


__all__ = [
    "COMPILED_IMPORTANCE_REFUSAL",
    "compiles_wrongly",
    "BACKENDS",
    "CudaGraphCapture",
    "CudaGraphRuntime",
    "EncoderRuntime",
    "EngineProcess",
    "EngineProcessError",
    "ExportedRuntime",
    "INT8_DEPRECATION",
    "OnnxRuntimeRuntime",
    "OpenVINORuntime",
    "OPTION_DEFAULTS",
    "RUNTIMES",
    "RuntimeOptions",
    "TorchEagerRuntime",
    "auto_precision",
    "choose",
    "device_type",
    "embeddings_label",
    "isolated_by_default",
    "read_message",
    "serve",
    "write_message",
    "names_for_device",
    "resolve",
]
