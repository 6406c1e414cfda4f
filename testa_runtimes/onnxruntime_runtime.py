"""ONNX Runtime on the CPU (`OnnxRuntimeRuntime`, ``backend="onnxruntime"``): ONNX (opset 18) by the dynamo exporter;
fp32, int8 by its static quantization (QDQ), calibrated in bounded memory. What all exported runtimes share is
`exported.py`'s."""

import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from testa_runtimes.encoder_runtime import EncoderGraph
from testa_runtimes.exported import ExportedRuntime
from testa_runtimes.graph_surgery import (attention_output_matmuls, attention_product_matmuls, key_projection_matmuls,
                                          matching_matmuls, onnx_nodes)


def sort_as_topk(self, stable: bool = False, dim: int = -1, descending: bool = False):
    """ONNX translation of ``aten.sort.stable``: `TopK` over the whole axis. ONNX's TopK puts the lower index first
    among equal values, which is what a stable sort does."""
    from onnxscript import opset18 as op

    k = op.Gather(op.Shape(self), op.Constant(value_ints=[dim]))
    values, indices = op.TopK(self, k, axis=dim, largest=descending, sorted=True)
    return values, indices


def onnx_calibration_ranges(path: Path, samples: Iterable[dict[str, Any]], op_types: list[str], work_dir: Path
                            ) -> Path:
    """The activation ranges of `quantize_static`'s own calibration (its MinMax calibrator with the settings
    `OnnxRuntimeRuntime.quantize` gives it: the inputs and outputs of ``op_types``, global minimum and maximum, not
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


class OnnxRuntimeRuntime(ExportedRuntime):
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

    @classmethod
    def load_graph(cls, path: Path, precision: str) -> Callable[[Any], list[Any]]:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = torch.get_num_threads()
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return lambda pixel_values: session.run(None, {"pixel_values": pixel_values})


__all__ = ["OnnxRuntimeRuntime", "onnx_calibration_ranges", "sort_as_topk"]
