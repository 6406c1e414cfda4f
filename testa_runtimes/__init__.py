"""Runtimes for a TESTA video encoder: what runs the model fast, kept apart from it (a Hub folder ships
`modeling_testa` only). `optimize_for_inference(model, precision, backend=...)` is the entry point
(`optimize.py`). One class per runtime, behind one interface (`encoder_runtime.EncoderRuntime`): `torch_eager.py`,
`cuda_graphs.py`, and the exported ones (`exported.py`, what they share) `openvino_runtime.py` and
`onnxruntime_runtime.py`; `registry.py` names them; `graph_surgery.py` selects and rewrites exported graphs' nodes;
`engine_worker.py` runs an engine in a process of its own; `linear_layers.py` holds the int8 and bfloat16 layers."""

from .linear_layers import Bf16Linear, Int8DynamicLinear
from .optimize import BACKENDS, PRECISIONS, optimize_for_inference
from .registry import isolated_by_default


__all__ = ["BACKENDS", "PRECISIONS", "Bf16Linear", "Int8DynamicLinear", "isolated_by_default", "optimize_for_inference"]
