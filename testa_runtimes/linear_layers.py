"""The linear layers `optimize_for_inference` converts the encoder to, and the conversion: `Bf16Linear` (bf16 weights,
bf16 compute, fp32 in and out), `Int8DynamicLinear` (int8 weights per channel, activations quantized per call and per
video, PyTorch's legacy quantized CPU kernels), `convert_linears` and `compile_blocks`. The PyTorch runtimes
(`torch_eager.TorchEagerRuntime`, `cuda_graphs.CudaGraphRuntime`) prepare models with them.
"""

import os
import shutil
import warnings

import torch
import torch.nn.functional as F
from torch import nn


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


__all__ = ["Bf16Linear", "INT8_ENGINE", "Int8DynamicLinear", "TEXT_MODULES", "compile_blocks", "convert_linears"]
