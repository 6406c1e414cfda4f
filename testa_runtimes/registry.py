"""The runtimes by name, and the choices made by name and device: which class ``backend=`` means (`resolve`,
`choose`), which backends run on a device (`names_for_device`), ``precision="auto"`` (`auto_precision`), what
long-lived callers pass as ``isolate`` (`isolated_by_default`) and what a store records (`embeddings_label`)."""

import logging

from torch import nn

from testa_runtimes.cuda_graphs import CudaGraphRuntime
from testa_runtimes.encoder_runtime import EncoderRuntime, device_type, quoted
from testa_runtimes.onnxruntime_runtime import OnnxRuntimeRuntime
from testa_runtimes.openvino_runtime import OpenVINORuntime
from testa_runtimes.torch_eager import TorchEagerRuntime


logger = logging.getLogger(__name__)


RUNTIMES: dict[str, type[EncoderRuntime]] = {
    runtime.name: runtime for runtime in (TorchEagerRuntime, CudaGraphRuntime, OpenVINORuntime, OnnxRuntimeRuntime)
}
"""The runtimes by name."""

BACKENDS = ("torch", "openvino", "onnxruntime", "torch-eager", "cuda-graphs")
"""The values `optimize_for_inference(backend=...)` accepts: the runtimes' names, and ``"torch"`` (`resolve`)."""


def resolve(backend: str, device: str, compile: bool = False) -> type[EncoderRuntime]:
    """The runtime class for ``backend`` on a model on ``device``: ``"torch"`` is CUDA graphs on CUDA (eager with
    ``compile=True``, which compiles the blocks instead) and eager elsewhere; every other name is its class."""
    if backend == "torch":
        return CudaGraphRuntime if device == "cuda" and not compile else TorchEagerRuntime
    if backend not in RUNTIMES:
        raise ValueError(f"backend={backend!r} is not supported; allowed values are {quoted(BACKENDS)}.")
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



__all__ = ["BACKENDS", "RUNTIMES", "auto_precision", "choose", "embeddings_label", "isolated_by_default",
           "names_for_device", "resolve"]
