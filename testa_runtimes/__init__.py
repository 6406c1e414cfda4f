"""Runtimes for a TESTA video encoder: what runs the model fast, kept apart from it (a Hub folder ships
`modeling_testa` only). `optimize_for_inference(model, precision, backend=...)` is the entry point
(`optimize.py`); `runtimes.py` holds one class per runtime (eager, CUDA graphs, OpenVINO, ONNX Runtime) and the
engine worker; `engines.py` the exported graphs; `linear_layers.py` the int8 and bfloat16 layers."""

from .linear_layers import Bf16Linear, Int8DynamicLinear
from .optimize import BACKENDS, PRECISIONS, optimize_for_inference
from .runtimes import isolated_by_default


__all__ = ["BACKENDS", "PRECISIONS", "Bf16Linear", "Int8DynamicLinear", "isolated_by_default", "optimize_for_inference"]
