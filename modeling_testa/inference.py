"""Fast inference for TESTA models: `optimize_for_inference(model, precision="fp32" | "bf16" | "int8" | "auto",
backend="torch" | "openvino" | "onnxruntime")`.

One call prepares a `TestaVisionModel` or any TESTA head for inference (in place; the same object is returned, in
`eval()` mode, with the same outputs API):

- ``"fp32"``: the model as it is, numerically unchanged. With ``compile=True`` every encoder block is compiled with
  `torch.compile` (TorchInductor, weights frozen as constants); compilation happens at the first forward of each input
  shape, and is skipped with a warning where no C++ compiler is found.
- ``"bf16"``: the `nn.Linear` layers of the encoder blocks (attention qkv and projections, ``temporal_fc``, MLP) keep
  their weights in bfloat16 and compute in bfloat16; their outputs come back in float32. Everything else stays fp32:
  the residual stream, LayerNorms, the attention softmax, and what decides and performs the merging: the similarity
  scores and matching (`aggregation.py` promotes to at least fp32), the token sizes and the size-weighted averages.
  Fast where the CPU has bf16 instructions (AVX-512 BF16, AMX) and on GPUs; on CPUs without them PyTorch emulates
  bf16 GEMMs and this is *slower* than fp32.
- ``"int8"``: the same linear layers become `Int8DynamicLinear`: int8 weights (symmetric, one scale per output
  channel) and activations quantized per call to uint8 (asymmetric, one scale per tensor), multiplied by PyTorch's
  quantized CPU kernels (`quantized::linear_dynamic`, the ``x86`` engine: FBGEMM or oneDNN picked by shape). CPU
  only. In the video encoder activations are quantized per video, so a video's embedding does not depend on the
  other videos of its batch. Matching and merging run in fp32 on the (int8-computed) keys.

``backend="openvino"`` / ``"onnxruntime"`` (`engines.py`) instead export the whole video encoder, its merging
included, as one graph run by that engine (fp32; bf16 on OpenVINO where the CPU has bf16 instructions; int8 by the
engine's own post-training quantization, the matching's matrix multiplies kept fp32), cached on disk. The legacy
``precision="int8"`` of ``backend="torch"`` (`Int8DynamicLinear`) warns that PyTorch deprecated its kernels
(`INT8_DEPRECATION`); it stays for installs without an engine extra, and as the reference the engines
are measured against.

By default only the video encoder is converted (``include_text=False``): it is where the time goes when indexing
videos, and the text modules (query encoder, matching head, QA decoder) stay exact. ``include_text=True`` converts
the linear layers of the text encoder (and decoder) too. Projections and heads always stay fp32.

An optimized model is for inference only: its `save_pretrained` (and `push_to_hub`, and a pipeline's
`save_pretrained`) refuses with a message saying so. Save the original model instead, and call
`optimize_for_inference` after every `from_pretrained`:

```python
model = optimize_for_inference(TestaForVideoTextRetrieval.from_pretrained(folder), precision="int8")
pipe = pipeline("video-text-retrieval", model=folder, precision="int8")  # the same, inside the pipeline
```

This file is Hub remote code (the pipelines import it): flat relative imports only.
"""

import logging
import os
import shutil
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .runtimes import BACKENDS, INT8_DEPRECATION, RUNTIMES, choose
from .saving import INFERENCE_ATTRIBUTE


logger = logging.getLogger(__name__)


PRECISIONS = ("fp32", "bf16", "int8")
"""The values `optimize_for_inference` accepts for `precision`."""

MODEL_CLASSES = ("TestaVisionModel", "TestaForVideoTextRetrieval", "TestaForVideoQA", "TestaForPreTraining")
"""The models `optimize_for_inference` accepts (by class name, so that Hub remote-code copies work too)."""

TEXT_MODULES = ("text_encoder", "text_decoder")
"""The text modules of the heads converted with ``include_text=True`` (their transformer layers; never the momentum
copies, nor the decoder's LM head)."""

INT8_ENGINE = "x86"
"""The quantized engine of the int8 kernels: PyTorch's recommended x86 engine, which dispatches to FBGEMM or oneDNN
per shape. (The engine is a process-wide setting; it is set when weights are packed and before every int8 call.)"""


# ----------------------------------------------------------------------------------------------------------------------
# Linear layers
# ----------------------------------------------------------------------------------------------------------------------


def _quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(qweight int8 (out, in), scale fp32 (out,))``, ``weight ~= q * scale``.
    The range is [-127, 127] (no -128), so that negating a weight is exact."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    qweight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scale


class _SampleContext:
    """Shared by the int8 layers of one video encoder: how many videos the current forward holds, so that the
    activations are quantized per video (a forward pre-hook of the encoder sets it)."""

    def __init__(self) -> None:
        self.samples: int | None = None


class Int8DynamicLinear(nn.Module):
    r"""A `nn.Linear` with int8 weights and dynamically quantized activations, for CPU inference.

    - weights: symmetric int8, one scale per output channel (`_quantize_weight`), packed once for the kernel;
    - activations: quantized on every call to uint8 with one scale and zero point per tensor (the range of the
      input, widened to include 0) by the kernel itself. The engine reduces the activation range to 7 bits
      (`reduce_range=True`): on CPUs without VNNI the u8 x s8 multiply-add pairs would saturate int16 otherwise;
    - products accumulate in int32, and the output is dequantized and the fp32 bias added.

    With a `_SampleContext` that says the call holds ``n`` samples (the leading dimension is sample-major), the input
    is split into ``n`` equal parts quantized on their own, so every sample's result is what it would be alone.

    Args:
        linear (`nn.Linear`): the layer to convert (on the CPU).
    """

    def __init__(self, linear: nn.Linear, context: _SampleContext | None = None) -> None:
        super().__init__()
        if linear.weight.device.type != "cpu":
            raise ValueError(f"int8 inference runs on the CPU; this layer is on {linear.weight.device}.")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        qweight, scale = _quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)
        self.context = context
        self._pack()

    def _pack(self) -> None:
        torch.backends.quantized.engine = INT8_ENGINE
        with warnings.catch_warnings():  # quantized tensors are only the packing's input format here
            warnings.simplefilter("ignore")
            quantized = torch._make_per_channel_quantized_tensor(
                self.qweight, self.weight_scale.double(), torch.zeros_like(self.weight_scale, dtype=torch.long), 0
            )
            self._packed = torch.ops.quantized.linear_prepack(quantized, self.bias)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        if self.qweight.device.type != "cpu":
            raise ValueError("Int8DynamicLinear runs on the CPU only (PyTorch's quantized kernels are CPU kernels).")
        return result

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        x = x.reshape(-1, self.in_features).float()
        if torch.backends.quantized.engine != INT8_ENGINE:
            torch.backends.quantized.engine = INT8_ENGINE
        samples = self.context.samples if self.context is not None else None
        if samples and samples > 1 and shape[0] % samples == 0 and x.shape[0]:
            y = torch.cat([self._linear(part.contiguous()) for part in x.view(samples, -1, self.in_features)])
        else:
            y = self._linear(x.contiguous())
        return y.view(*shape[:-1], self.out_features).to(dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight the kernel multiplies by: ``qweight * weight_scale``."""
        return self.qweight.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               "weights=int8 per channel, activations=uint8 per tensor (dynamic)"


class Bf16Linear(nn.Module):
    """A `nn.Linear` whose weights are stored in bfloat16 and that computes in bfloat16; the output is cast back to
    the input's dtype, so the rest of the model (residuals, LayerNorms, attention softmax, matching) stays fp32."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).clone())
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               "dtype=bfloat16"


# ----------------------------------------------------------------------------------------------------------------------
# optimize_for_inference
# ----------------------------------------------------------------------------------------------------------------------


def _class_names(model: Any) -> set[str]:
    return {cls.__name__ for cls in type(model).__mro__}


def _vision_model(model: nn.Module) -> nn.Module:
    return model if "TestaVisionModel" in _class_names(model) else model.vision_model


def _replace_linears(root: nn.Module, convert) -> int:
    """Replaces every `nn.Linear` below `root` by ``convert(linear)``; returns how many were replaced."""
    count = 0
    for name, child in list(root.named_children()):
        if type(child) is nn.Linear:
            setattr(root, name, convert(child))
            count += 1
        else:
            count += _replace_linears(child, convert)
    return count


def _has_cxx_compiler() -> bool:
    candidates = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    return any(c and shutil.which(c) for c in candidates)


def _set_samples(context: _SampleContext):
    def hook(module, args, kwargs):
        pixel_values = args[0] if args else kwargs.get("pixel_values")
        context.samples = int(pixel_values.shape[0]) if isinstance(pixel_values, torch.Tensor) else None

    return hook


def convert_linears(model: nn.Module, vision: nn.Module, precision: str, include_text: bool) -> int:
    """Replaces the linear layers of the encoder blocks (and, with ``include_text``, of the text transformers) by
    their bf16 or int8 versions; returns how many were replaced (0 for fp32)."""
    targets = [vision.layers]
    if include_text:  # the text transformers; the decoder's LM head (tied to the word embeddings) stays as it is
        for name in TEXT_MODULES:
            module = getattr(model, name, None)
            module = getattr(module, "bert", module)
            if isinstance(module, nn.Module):
                targets.append(module)
    converted = 0
    if precision == "bf16":
        for target in targets:
            converted += _replace_linears(target, Bf16Linear)
    elif precision == "int8":
        context = _SampleContext()
        converted += _replace_linears(vision.layers, lambda linear: Int8DynamicLinear(linear, context))
        for target in targets[1:]:
            converted += _replace_linears(target, Int8DynamicLinear)
        vision.register_forward_pre_hook(_set_samples(context), with_kwargs=True)
    return converted


def compile_blocks(vision: nn.Module) -> bool:
    """`torch.compile` of every encoder block (weights frozen); returns whether it was done (not on a CPU without a
    C++ compiler, with a warning)."""
    device = next(vision.parameters()).device
    if not _has_cxx_compiler() and device.type == "cpu":
        warnings.warn("optimize_for_inference(compile=True): no C++ compiler found (TorchInductor needs one on "
                      "the CPU); the model is left uncompiled.", stacklevel=4)
        return False
    for layer in vision.layers:
        layer.compile(options={"freezing": True})
    return True


def optimize_for_inference(
    model: nn.Module,
    precision: str = "fp32",
    *,
    backend: str = "torch",
    compile: bool = False,
    include_text: bool = False,
    cache_dir: str | os.PathLike | None = None,
    calibration: torch.Tensor | None = None,
    isolate: bool = False,
) -> nn.Module:
    r"""Prepares a TESTA model for fast inference, in place, and returns it (the same object, in `eval()` mode).

    The video encoder is then run by a runtime (`runtimes.py`), picked by ``backend`` and held by the vision model's
    ``runtime`` attribute; `TestaVisionModel.forward` hands every call to it.

    Args:
        model: a `TestaVisionModel` or a TESTA head (`TestaForVideoTextRetrieval`, `TestaForVideoQA`,
            `TestaForPreTraining`).
        precision (`str`, defaults to `"fp32"`): one of `PRECISIONS` the runtime offers, or `"auto"`: the fastest
            precision within the quality contract for the runtime and device (`EncoderRuntime.auto_precision`: int8
            on the CPU, bf16 on a GPU; logged):

            - `"fp32"`: numerically the model as it is (with `compile=True`: compiled encoder blocks);
            - `"bf16"`: the encoder blocks' linear layers in bfloat16, everything else (matching and merging
              included) in fp32. Fast only with bf16 hardware (AVX-512 BF16 / AMX CPUs, GPUs);
            - `"int8"`: on the CPU; with `backend="torch"` the encoder blocks' linear layers as `Int8DynamicLinear`
              (deprecated PyTorch kernels), with the engines their own post-training quantization.
        backend (`str`, defaults to `"torch"`): one of `BACKENDS`, the name of a runtime (`runtimes.RUNTIMES`):

            - `"torch"`: PyTorch; on a CUDA model the encoder is captured as a CUDA graph per input shape
              (`"cuda-graphs"`, falling back to eager where a graph cannot serve, logged), elsewhere (or with
              `compile=True`) eager (`"torch-eager"`);
            - `"openvino"` / `"onnxruntime"`: the video encoder, merging included, as one exported graph
              (`engines.ExportedEncoder`; CPU; fp32, bf16 (OpenVINO, CPUs with bf16 instructions) or int8); the text
              modules stay PyTorch fp32. Needs the `openvino` / `onnxruntime` extra. The graph of each input shape is
              exported on first use (minutes for ViT-B) and cached in `cache_dir`.
        cache_dir (`str`, *optional*): where exported graphs are kept (default `$HF_HOME/testa/engines`); engine
            backends only.
        calibration (`torch.Tensor`, *optional*): `(videos, frames, channels, height, width)` normalised pixel values
            that calibrate int8 for the engine backends (a few videos of the target domain; default: synthetic
            videos, `engines.default_calibration_videos`).
        compile (`bool`, defaults to `False`): also `torch.compile` every encoder block (weights frozen; eager
            runtime). The first forward of each input shape compiles (minutes for ViT-B on a small CPU). Skipped with
            a warning when no C++ compiler is found. Tested with `"fp32"`.
        include_text (`bool`, defaults to `False`): also convert the linear layers of the text encoder/decoder
            (PyTorch runtimes).
        isolate (`bool`, defaults to `False`): run the engine (`"openvino"`, `"onnxruntime"`) in a worker process
            of its own (`runtimes.EngineProcess`): a native crash of the engine then raises `EngineProcessError` in
            the caller instead of killing it, and the next call starts a new worker. For processes that live long
            (the app and `train.index` do it by default); a call costs the pipe transfer of its pixels.

    Returns:
        The same model. Its outputs API is unchanged. Its `save_pretrained` raises: an optimized model is for
        inference only (save the original one, and optimize after loading).

    Raises:
        `ValueError`: `backend` or `precision` is not one the runtime offers on the model's device, an option the
            runtime does not take was given, or the model was already optimized (each message names the allowed
            values).
        `ImportError`: the runtime's package is missing (the message names the extra to install).
        `TypeError`: `model` is not a TESTA model.
    """
    names = _class_names(model)
    if not isinstance(model, nn.Module) or not names & set(MODEL_CLASSES):
        raise TypeError(
            f"optimize_for_inference takes a TESTA model ({', '.join(MODEL_CLASSES)}), got {type(model).__name__}."
        )
    vision = _vision_model(model)
    runtime_class, precision = choose(backend, precision, vision, compile)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; allowed values are "
                         f"{', '.join(map(repr, PRECISIONS))} and 'auto'.")
    previous = getattr(model, INFERENCE_ATTRIBUTE, None)
    if previous is not None:
        raise ValueError(
            f"This {type(model).__name__} was already prepared with optimize_for_inference ({previous}); load the "
            "original model again to choose other settings."
        )
    options = {"compile": compile, "include_text": include_text, "cache_dir": cache_dir, "calibration": calibration,
               "isolate": isolate}
    runtime_class.check(vision, precision, options, backend)
    model.eval()
    runtime = runtime_class(vision, precision, **{name: options[name] for name in runtime_class.options})
    settings = {"precision": precision, "backend": backend, "runtime": runtime_class.name, "compile": False,
                "include_text": False, "converted_linears": 0}
    settings.update(runtime.prepare(model))
    vision.runtime = runtime
    _mark_optimized(model, settings)
    return model


def _mark_optimized(model: nn.Module, settings: dict) -> None:
    for module in model.modules():  # the model and its sub-models (e.g. `vision_model`) all refuse to be saved
        if hasattr(module, "save_pretrained"):
            setattr(module, INFERENCE_ATTRIBUTE, dict(settings))


__all__ = ["BACKENDS", "Bf16Linear", "INT8_DEPRECATION", "Int8DynamicLinear", "MODEL_CLASSES", "PRECISIONS", "RUNTIMES",
           "compile_blocks", "convert_linears", "optimize_for_inference"]
