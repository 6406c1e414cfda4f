"""OpenVINO on the CPU (`OpenVINORuntime`, ``backend="openvino"``): IR converted from `torch.export`; fp32, bf16 (the
linear layers in bf16, in the graph) and int8 by NNCF. What all exported runtimes share is `exported.py`'s."""

import threading
from pathlib import Path
from typing import Any, Callable

import torch

from testa_runtimes.encoder_runtime import EncoderGraph
from testa_runtimes.exported import ExportedRuntime, cpu_has_bf16, export_program
from testa_runtimes.graph_surgery import (FOLDED_SUFFIX, attention_output_matmuls, fold_linear_pairs,
                                          linear_layers_in_bf16, matching_matmuls, openvino_nodes)


_OPENVINO_CORE: list = []
_OPENVINO_CORE_LOCK = threading.Lock()


def openvino_core() -> Any:
    """The one `openvino.Core` of this process, created at first use and never destroyed before exit.

    Why one: OpenVINO's CPU plugin gives the thread that compiles or runs a model an alternate signal stack
    (``sigaltstack``) of its own, saving the thread's previous one, and puts the saved one back when its `Core` is
    destroyed. With a `Core` per graph, destroyed in another order than created (as garbage collection does), a
    thread is left with an alternate stack that was freed: the next signal with a Python handler (CPython installs
    them with ``SA_ONSTACK``; e.g. the SIGCHLD of a DataLoader worker or of a helper process) cannot be delivered, and
    the kernel kills the process with SIGSEGV, without a traceback (faulthandler runs on that stack too). That was the
    segfault of long pytest runs, mid-run and at exit (`tests/test_engines.py`
    `test_openvino_graphs_freed_in_any_order_leave_signals_deliverable`, docs/inference.md)."""
    with _OPENVINO_CORE_LOCK:
        if not _OPENVINO_CORE:
            import openvino as ov

            _OPENVINO_CORE.append(ov.Core())
        return _OPENVINO_CORE[0]


class OpenVINORuntime(ExportedRuntime):
    """OpenVINO on the CPU: IR converted from `torch.export`; fp32 (the ``f32`` inference hint: on CPUs with bf16
    instructions its default is bf16), bf16 (CPUs with AVX-512 BF16 or AMX: the linear layers in bf16, in the graph,
    `linear_layers_in_bf16`), int8 by NNCF."""

    name = "openvino"
    extra = "openvino"
    packages = ("openvino", "nncf")
    precisions = ("fp32", "bf16", "int8")
    graph_file = "encoder.xml"
    attention_types = ("ScaledDotProductAttention",)
    quantizer_type = "FakeQuantize"

    @classmethod
    def export(cls, graph: EncoderGraph, example: torch.Tensor, folder: Path) -> Path:
        import openvino as ov

        model = ov.convert_model(export_program(graph, example))
        path = folder / cls.file_name("fp32")
        ov.save_model(model, str(path), compress_to_fp16=False)
        return path

    @classmethod
    def quantize(cls, path: Path, calibration: torch.Tensor, folder: Path) -> Path:
        """NNCF post-training int8 (transformer preset). Left in fp32: the matching's products
        (`matching_matmuls`) and the temporal attention's output branch, folded into one layer first
        (`fold_linear_pairs`; bf16 where the CPU has it, when loaded)."""
        import nncf
        import openvino as ov

        model = openvino_core().read_model(str(path))
        temporal_branch = fold_linear_pairs(model, attention_output_matmuls(openvino_nodes(model), min_chain=2))
        ignored = sorted(set(matching_matmuls(openvino_nodes(model))) | set(temporal_branch))
        dataset = nncf.Dataset([video[None].numpy() for video in calibration])
        quantized = nncf.quantize(model, dataset, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(calibration),
                                  ignored_scope=nncf.IgnoredScope(names=ignored, validate=False))
        out = folder / cls.file_name("int8")
        ov.save_model(quantized, str(out), compress_to_fp16=False)
        return out

    @classmethod
    def graph_nodes(cls, path: Path) -> dict[str, tuple[str, list[str]]]:
        return openvino_nodes(openvino_core().read_model(str(path)))

    @classmethod
    def load_graph(cls, path: Path, precision: str) -> Callable[[Any], list[Any]]:
        core = openvino_core()
        model = core.read_model(str(path))
        if precision == "bf16":
            linear_layers_in_bf16(model)
        elif precision == "int8" and cpu_has_bf16():  # int8's fp32 exception, at twice fp32's speed
            linear_layers_in_bf16(model, selected=lambda name: name.endswith(FOLDED_SUFFIX))
        # The hint is f32 for every precision: int8 graphs keep their other parts in fp32, and bf16 is in the graph
        # itself (`linear_layers_in_bf16`), since the plugin's bf16 hint would round everything else too.
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
                                                     "INFERENCE_NUM_THREADS": torch.get_num_threads()})

        def run(pixel_values: Any) -> list[Any]:
            result = compiled(pixel_values)
            return [result[i] for i in range(len(result))]

        return run


__all__ = ["OpenVINORuntime", "openvino_core"]
