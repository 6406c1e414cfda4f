"""CUDA graphs (`CudaGraphRuntime`, ``backend="cuda-graphs"``; ``"torch"`` on CUDA).

The token counts after every merge are fixed by the settings and the input shape, so the whole encoder (embeddings,
every block with its matching and merging, the final LayerNorm) can be captured once per input shape and replayed:
one launch instead of the hundreds of kernel launches an eager forward makes (on CUDA each matching and its merge are
two fused kernels, `fused_aggregation`, which a graph captures like any other). A shape runs eager the first time it
is seen (the warm-up that capture needs; a one-off shape, such as the last partial batch of a folder, costs no
capture), and is captured the next time. Where a graph cannot serve a call, the call runs eager and the reason is
logged once per shape: hidden states or attentions requested (the graph returns the last hidden state, the token
sizes and the source map), autograd on, or ``max_graphs`` shapes already captured.
"""

import logging
import threading
from typing import Any, Callable

import torch
from torch import nn

from modeling_testa.modeling_testa_vision import TestaVisionModelOutput
from testa_runtimes.encoder_runtime import EncoderGraph, EncoderRuntime
from testa_runtimes.linear_layers import convert_linears


logger = logging.getLogger(__name__)


class CudaGraphCapture:
    """Captures ``function(static_input)`` as a CUDA graph: a warm-up on a side stream (as capture requires), then the
    capture. Returns ``(replay, static_outputs)``: ``replay()`` re-runs the captured kernels on whatever
    ``static_input`` holds and leaves the results in ``static_outputs``."""

    def __call__(self, function: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], static_input: torch.Tensor
                 ) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
        with torch.cuda.device(static_input.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                function(static_input)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_outputs = function(static_input)
        return graph.replay, static_outputs


class CudaGraphRuntime(EncoderRuntime):
    """The encoder captured as a CUDA graph per input shape and replayed (see the module docstring): the GPU path
    without kernel-launch overhead. The linear layers are converted as `TorchEagerRuntime` converts them (bf16), and a
    graph replays the kernels the eager forward launched while it was captured, so its outputs should equal eager's
    (checked on the CPU with a stand-in capture; not yet on a GPU).

    Args:
        vision_model, precision: as for every runtime.
        max_graphs (`int`, defaults to 8): how many input shapes are captured (each graph keeps its own memory);
            further shapes run eager.
        warmup_calls (`int`, defaults to 1): how many times a shape runs eager before it is captured.
        capture: what captures a graph (`CudaGraphCapture`; tests on the CPU pass another).
    """

    name = "cuda-graphs"
    devices = ("cuda",)
    precisions = ("fp32", "bf16")
    options = ("include_text", "fused_kernels")
    outputs = ()
    falls_back = True

    def __init__(self, vision_model: nn.Module, precision: str, max_graphs: int = 8, warmup_calls: int = 1,
                 capture: Callable | None = None, **options: Any) -> None:
        super().__init__(vision_model, precision, **options)
        self.max_graphs = max_graphs
        self.warmup_calls = warmup_calls
        self.capture = capture if capture is not None else CudaGraphCapture()
        self.graphs: dict[tuple, tuple[torch.Tensor, Callable[[], None], tuple[torch.Tensor, ...]]] = {}
        self.calls: dict[tuple, int] = {}  # eager calls per shape, before its capture
        self.logged: set[tuple] = set()
        self.replays = 0
        self.lock = threading.Lock()  # a graph's static buffers serve one call at a time

    def prepare(self, model: nn.Module) -> dict[str, Any]:
        converted = convert_linears(model, self.vision_model, self.precision, self.options["include_text"])
        return {"include_text": self.options["include_text"], "converted_linears": converted,
                "max_graphs": self.max_graphs}

    def key(self, pixel_values: torch.Tensor, trace_source: bool) -> tuple:
        """What a graph is specific to: the input's shape, dtype and device, source tracing, and the model's
        aggregation settings, its score grid included (`set_aggregation` after `optimize_for_inference` gives other
        token counts or other decisions: another graph). The merge's kernels are this runtime's own option, fixed
        for its life."""
        settings = self.vision_model.aggregation_settings(trace_source)
        return (tuple(pixel_values.shape), pixel_values.dtype, str(pixel_values.device), repr(settings))

    def fallback_reason(self, key: tuple, output_hidden_states: bool, output_attentions: bool) -> str | None:
        """Why this call runs eager, or ``None`` when a graph serves it."""
        unavailable = self.unavailable_outputs(output_hidden_states, output_attentions)
        if unavailable:
            return (f"{' and '.join(f'{n}=True' for n in unavailable)}: a captured graph returns the last hidden "
                    "state, the token sizes and the source map only")
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.vision_model.parameters()):
            return "autograd is on (a captured graph is for inference: call it under torch.no_grad())"
        if key in self.graphs:
            return None
        if self.calls.get(key, 0) < self.warmup_calls:
            return "a shape not seen before (it runs eager once, as a warm-up, and is captured if it comes again)"
        if len(self.graphs) >= self.max_graphs:
            return f"{self.max_graphs} shapes are captured already (max_graphs): further shapes run eager"
        return None

    def log_fallback(self, key: tuple, reason: str) -> None:
        if (key, reason) not in self.logged:
            self.logged.add((key, reason))
            logger.info("cuda-graphs: input %s runs eager: %s.", key[0], reason)

    def graph_function(self, trace_source: bool) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        """``pixel_values -> (last_hidden_state, token_sizes[, source_map])``: what is captured."""
        graph = EncoderGraph(self.vision_model, trace_source, self.options["fused_kernels"])

        def function(pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                return graph(pixel_values)

        return function

    def replay(self, key: tuple, pixel_values: torch.Tensor, trace_source: bool) -> tuple[torch.Tensor, ...]:
        """Copies the input into the graph's static input, replays, and returns copies of the static outputs (the
        next replay overwrites them)."""
        with self.lock:
            if key not in self.graphs:
                with torch.inference_mode(False):  # a normal tensor: later calls may come outside inference mode
                    static_input = pixel_values.detach().clone()
                replay, static_outputs = self.capture(self.graph_function(trace_source), static_input)
                self.graphs[key] = (static_input, replay, static_outputs)
                logger.info("cuda-graphs: captured input %s (%d of at most %d graphs).", key[0], len(self.graphs),
                            self.max_graphs)
            static_input, replay, static_outputs = self.graphs[key]
            static_input.copy_(pixel_values)
            replay()
            self.replays += 1
            return tuple(output.clone() for output in static_outputs)

    def __call__(self, pixel_values, output_hidden_states=False, output_attentions=False, trace_source=None):
        model = self.vision_model
        model.check_pixel_values(pixel_values)
        trace = bool(model.config.trace_source if trace_source is None else trace_source)
        key = self.key(pixel_values, trace)
        reason = self.fallback_reason(key, output_hidden_states, output_attentions)
        if reason is not None:
            self.log_fallback(key, reason)
            self.calls[key] = self.calls.get(key, 0) + 1
            return model.eager_forward(pixel_values, output_hidden_states, output_attentions, trace_source,
                                       self.options["fused_kernels"])
        outputs = self.replay(key, pixel_values, trace)
        last_hidden_state = outputs[0]
        return TestaVisionModelOutput(last_hidden_state=last_hidden_state, pooler_output=last_hidden_state[:, 0],
                                      token_sizes=outputs[1], source_map=outputs[2] if trace else None)



__all__ = ["CudaGraphCapture", "CudaGraphRuntime"]
