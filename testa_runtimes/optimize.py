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

``backend="openvino"`` / ``"onnxruntime"`` (`exported.py`) instead export the whole video encoder, its merging
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
"""

import inspect
import logging
from typing import Any

from torch import nn

from modeling_testa.saving import INFERENCE_ATTRIBUTE
from testa_runtimes.encoder_runtime import OPTION_DEFAULTS, RuntimeOptions
from testa_runtimes.fingerprints import name_converted_weights, weights_fingerprint
from testa_runtimes.linear_layers import Bf16Linear, Int8DynamicLinear
from testa_runtimes.registry import BACKENDS, RUNTIMES, choose
from testa_runtimes.torch_eager import INT8_DEPRECATION


logger = logging.getLogger(__name__)


PRECISIONS = ("fp32", "bf16", "int8")
"""The values `optimize_for_inference` accepts for `precision`."""

MODEL_CLASSES = ("TestaVisionModel", "TestaForVideoTextRetrieval", "TestaForVideoQA", "TestaForPreTraining")
"""The models `optimize_for_inference` accepts (by class name, so that Hub remote-code copies work too)."""


def _class_names(model: Any) -> set[str]:
    return {cls.__name__ for cls in type(model).__mro__}


def _vision_model(model: nn.Module) -> nn.Module:
    return model if "TestaVisionModel" in _class_names(model) else model.vision_model


def optimize_for_inference(model: nn.Module, precision: str = "fp32", *, backend: str = "torch",
                           **options: Any) -> nn.Module:
    r"""Prepares a TESTA model for fast inference, in place, and returns it (the same object, in `eval()` mode).

    The video encoder is then run by a runtime (`encoder_runtime.EncoderRuntime`), picked by ``backend`` and held by
    the vision model's ``runtime`` attribute; `TestaVisionModel.forward` hands every call to it.

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
        backend (`str`, defaults to `"torch"`): one of `BACKENDS`, the name of a runtime (`registry.RUNTIMES`):

            - `"torch"`: PyTorch; on a CUDA model the encoder is captured as a CUDA graph per input shape
              (`"cuda-graphs"`, falling back to eager where a graph cannot serve, logged), elsewhere (or with
              `compile=True`) eager (`"torch-eager"`);
            - `"openvino"` / `"onnxruntime"`: the video encoder, merging included, as one exported graph
              (`exported.ExportedRuntime`; CPU; fp32, bf16 (OpenVINO, CPUs with bf16 instructions) or int8); the text
              modules stay PyTorch fp32. Needs the `openvino` / `onnxruntime` extra. The graph of each input shape is
              exported on first use (minutes for ViT-B) and cached in `cache_dir`.
        **options: the runtime's options, declared once in `encoder_runtime.RuntimeOptions` (names, defaults, meaning):
            `compile`, `include_text` (PyTorch eager), `cache_dir`, `calibration`, `isolate` (the exported
            runtimes), `fused_kernels` (the PyTorch runtimes: `"auto"`, `"off"`, `"interpret"`). An option the
            runtime does not take is refused unless it is left at its default.

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
    options = RuntimeOptions.of(options)  # unknown names refused before anything is done
    runtime_class, precision = choose(backend, precision, vision, options["compile"])
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; allowed values are "
                         f"{', '.join(map(repr, PRECISIONS))} and 'auto'.")
    previous = getattr(model, INFERENCE_ATTRIBUTE, None)
    if previous is not None:
        raise ValueError(
            f"This {type(model).__name__} was already prepared with optimize_for_inference ({previous}); load the "
            "original model again to choose other settings."
        )
    runtime_class.check(vision, precision, options, backend)
    model.eval()
    runtime = runtime_class(vision, precision, **{name: options[name] for name in runtime_class.options})
    original = weights_fingerprint(model)  # an index names the model by these weights, not by their converted copies
    settings = {"precision": precision, "backend": backend, "runtime": runtime_class.name, "compile": False,
                "include_text": False, "converted_linears": 0}
    settings.update(runtime.prepare(model))
    vision.runtime = runtime
    _mark_optimized(model, settings)
    name_converted_weights(model, original)
    return model


# The options are keywords of the signature `help()` and `inspect.signature` show, built from their one declaration.
optimize_for_inference.__signature__ = inspect.signature(optimize_for_inference).replace(parameters=[
    *[p for p in inspect.signature(optimize_for_inference).parameters.values() if p.kind != p.VAR_KEYWORD],
    *[inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                        annotation=RuntimeOptions.__annotations__[name]) for name, default in OPTION_DEFAULTS.items()],
])


def _mark_optimized(model: nn.Module, settings: dict) -> None:
    for module in model.modules():  # the model and its sub-models (e.g. `vision_model`) all refuse to be saved
        if hasattr(module, "save_pretrained"):
            setattr(module, INFERENCE_ATTRIBUTE, dict(settings))


__all__ = ["BACKENDS", "Bf16Linear", "INT8_DEPRECATION", "Int8DynamicLinear", "MODEL_CLASSES", "PRECISIONS", "RUNTIMES",
           "optimize_for_inference"]
