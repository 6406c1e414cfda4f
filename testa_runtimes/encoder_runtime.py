"""What every runtime of the TESTA video encoder shares: the one interface (`EncoderRuntime`), the options of
`optimize_for_inference` (`RuntimeOptions`, declared once), and the encoder as one graph (`EncoderGraph`: what an
exported runtime exports and the CUDA-graph runtime captures).

One class per way of running the encoder, all behind `EncoderRuntime` (as Optimum has one model class per engine);
the registry (`registry.RUNTIMES`) names them:

=================  ============================  ===========  ==========================  ===========================
name               class                         devices      precisions                  cannot give
=================  ============================  ===========  ==========================  ===========================
``"torch"``        picks by device: `CudaGraphRuntime` on CUDA (unless ``compile=True``), `TorchEagerRuntime` elsewhere
``"torch-eager"``  `TorchEagerRuntime`           any          fp32, bf16, int8 (CPU;      (everything is given)
                   (`torch_eager.py`)                         legacy, deprecated)
``"cuda-graphs"``  `CudaGraphRuntime`            cuda         fp32, bf16                  runs eager instead (logged):
                   (`cuda_graphs.py`)                                                     hidden states, attentions,
                                                                                          autograd, new shapes
``"openvino"``     `OpenVINORuntime`             cpu          fp32, bf16 (CPUs with bf16  hidden states, attentions
                   (`openvino_runtime.py`)                    instructions), int8         (refused)
``"onnxruntime"``  `OnnxRuntimeRuntime`          cpu          fp32, int8                  hidden states, attentions
                   (`onnxruntime_runtime.py`)                                             (refused)
=================  ============================  ===========  ==========================  ===========================

`optimize_for_inference(model, precision, backend=NAME)` picks a runtime class (`registry.choose`), checks in one
place that it can run this model (`EncoderRuntime.check`), creates it for the vision model, lets it convert the model
(`EncoderRuntime.prepare`) and stores it in the vision model's ``runtime`` attribute; `TestaVisionModel.forward` then
hands every call to it (nothing is monkeypatched: a model whose ``runtime`` is ``None`` runs its own eager forward).
Each class declares what it cannot do as class attributes (``devices``, ``precisions``, ``options``, ``outputs``,
``packages``), and `EncoderRuntime.check` turns them into one error naming the runtime, the option and the allowed
values. ``precision="auto"`` asks the runtime (`EncoderRuntime.auto_precision`): int8 on the CPU, bf16 on CUDA.
"""

import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from modeling_testa.aggregation_block import sequence, token_sizes_with_cls
from modeling_testa.fused_aggregation import check_option as check_fused_kernels_option

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
            `exported.default_calibration_videos`).
        isolate: run the engine of an exported runtime in a worker process of its own
            (`engine_worker.EngineProcess`): a native crash of the engine then raises `EngineProcessError` in the
            caller instead of killing it, and the next call starts a new worker. For processes that live long (the
            app and `train.index` do it by default); a call costs the pipe transfer of its pixels.
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
                             f"options are {', '.join(f'`{n}`' for n in OPTION_DEFAULTS)} (encoder_runtime.RuntimeOptions).")
        complete = {**OPTION_DEFAULTS, **options}
        check_fused_kernels_option(complete["fused_kernels"])
        return complete


OPTION_DEFAULTS: dict[str, Any] = {option.name: option.default for option in fields(RuntimeOptions)}
"""`RuntimeOptions`' defaults by name."""


def is_default(name: str, value: Any) -> bool:
    """Whether ``value`` is the default of option ``name`` (`OPTION_DEFAULTS`; a tensor never is)."""
    default = OPTION_DEFAULTS[name]
    return value is default or (not isinstance(value, torch.Tensor) and value == default)


def quoted(values) -> str:
    """``'a', 'b'``: how messages list allowed values."""
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
                             f"{quoted(cls.precisions)} (and 'auto').")
        if precision not in cls.allowed_precisions(device):
            raise ValueError(f"precision={precision!r} runs on the CPU only (int8 kernels are CPU kernels); the model "
                             f"is on {device}. Allowed values of {cls.label(backend)} there are "
                             f"{quoted(cls.allowed_precisions(device))}; use precision='bf16' on GPUs.")

    @classmethod
    def check(cls, vision_model: nn.Module, precision: str, options: dict[str, Any],
              backend: str | None = None) -> None:
        """Every refusal of this runtime, in one place: the device, the precision, the options (`ValueError`,
        naming the allowed values), missing packages (`ImportError`, naming the extra) and the model's settings.
        ``backend``: the name the caller used, for the messages."""
        from testa_runtimes.registry import RUNTIMES, names_for_device  # the registry imports every runtime

        device = device_type(vision_model)
        if cls.devices is not None and device not in cls.devices:
            raise ValueError(f"{cls.label(backend)} runs on {' or '.join(cls.devices)}; the model is on {device}. "
                             f"Backends for {device}: {quoted(names_for_device(device))}.")
        cls.check_precision(precision, device, backend)
        options = RuntimeOptions.of(options)
        given = [name for name, value in options.items() if not is_default(name, value)]
        refused = [name for name in given if name not in cls.options]
        if refused:
            takers = [n for n, c in RUNTIMES.items() if set(refused) <= set(c.options)]
            verb = "is not an option" if len(refused) == 1 else "are not options"
            raise ValueError(
                f"{' and '.join(f'`{n}`' for n in refused)} {verb} of {cls.label(backend)} (its options: {', '.join(f'`{o}`' for o in cls.options) or 'none'}); "
                f"{'backends that take it: ' + quoted(takers) if takers else 'no backend takes them together'}."
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


__all__ = ["OPTION_DEFAULTS", "EncoderGraph", "EncoderRuntime", "RuntimeOptions", "device_type", "is_default", "quoted"]
