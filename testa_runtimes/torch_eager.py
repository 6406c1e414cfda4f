"""PyTorch eager (`TorchEagerRuntime`, ``backend="torch-eager"``; ``"torch"`` off CUDA or with ``compile=True``): the
model's own forward, its linear layers converted for the precision, its blocks compiled on request."""

import warnings
from typing import Any

from torch import nn

from testa_runtimes.encoder_runtime import EncoderRuntime
from testa_runtimes.linear_layers import compile_blocks, convert_linears


INT8_DEPRECATION = (
    "optimize_for_inference(precision='int8', backend='torch') uses PyTorch's legacy quantized kernels "
    "(torch.ops.quantized.linear_prepack / linear_dynamic), whose eager quantization workflow PyTorch has deprecated; "
    "it will be removed when PyTorch removes them. backend='openvino' gives int8 on a maintained engine (and is "
    "faster: docs/inference.md)."
)
"""The warning of the legacy torch int8 path."""


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



__all__ = ["COMPILED_IMPORTANCE_REFUSAL", "INT8_DEPRECATION", "TorchEagerRuntime", "compiles_wrongly"]
