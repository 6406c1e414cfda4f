"""The runtimes of the video encoder (`testa_runtimes`, one class each): the registry and the choice by name and
device, one refusal per thing a runtime cannot do (naming the runtime, the option and the allowed values), the model's
forward handing calls to its ``runtime`` attribute, and the CUDA-graph runtime's logic (capture per shape, static
buffers, fallback to eager with the reason logged) run on the CPU.

No GPU runs here: CUDA graph capture itself (`CudaGraphCapture`) is replaced by `ReplayOnCpu`, which does on the CPU
what a capture and a replay do to the runtime's buffers (the captured function writes into static outputs that the
next replay overwrites), so everything around the capture is tested against the eager forward."""

import logging
import threading

import pytest
import torch
from helpers.models import random_vision_model, videos

import testa_runtimes.encoder_runtime as encoder_runtime
import testa_runtimes.registry as registry
from modeling_testa import TestaVisionModel
from testa_runtimes import Bf16Linear, optimize_for_inference
from testa_runtimes.cuda_graphs import CudaGraphRuntime
from testa_runtimes.encoder_runtime import OPTION_DEFAULTS
from testa_runtimes.exported import ExportedRuntime
from testa_runtimes.onnxruntime_runtime import OnnxRuntimeRuntime
from testa_runtimes.openvino_runtime import OpenVINORuntime
from testa_runtimes.registry import BACKENDS, RUNTIMES, embeddings_label, isolated_by_default, resolve
from testa_runtimes.torch_eager import TorchEagerRuntime


def _vision_model(seed: int = 0, **overrides) -> TestaVisionModel:
    return random_vision_model(seed, **overrides)


def _video(batch: int = 2, frames: int = 8, seed: int = 1) -> torch.Tensor:
    return videos(batch, frames, seed=seed)


class ReplayOnCpu:
    """Stands in for `CudaGraphCapture` on the CPU. "Capture" runs the function once on the static input and keeps
    its outputs as the static outputs; "replay" runs it again on whatever the static input holds now and writes the
    results into those same tensors, as replaying a CUDA graph does."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, ...]] = []

    def __call__(self, function, static_input):
        static_outputs = function(static_input)

        def replay():
            with torch.inference_mode():  # a graph's replay writes memory, outside autograd's bookkeeping
                for static, fresh in zip(static_outputs, function(static_input)):
                    static.copy_(fresh)

        self.captured.append(tuple(static_input.shape))
        return replay, static_outputs


class CpuGraphRuntime(CudaGraphRuntime):
    """`CudaGraphRuntime` with its capture done by `ReplayOnCpu`, allowed on the CPU (for these tests only)."""

    name = "cuda-graphs-on-cpu"
    devices = ("cpu",)

    def __init__(self, vision_model, precision, **options):
        super().__init__(vision_model, precision, capture=ReplayOnCpu(), **options)


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setitem(RUNTIMES, CpuGraphRuntime.name, CpuGraphRuntime)
    return CpuGraphRuntime.name


def _assert_same_output(got, expected) -> None:
    assert torch.equal(got.last_hidden_state, expected.last_hidden_state)
    assert torch.equal(got.pooler_output, expected.pooler_output)
    assert torch.equal(got.token_sizes, expected.token_sizes)
    assert (got.source_map is None) == (expected.source_map is None)
    if got.source_map is not None:
        assert torch.equal(got.source_map, expected.source_map)


# ------------------------------------------------------------------------------------------ registry and choice


def test_every_runtime_is_registered_by_its_name_and_declares_what_it_can_do():
    assert set(RUNTIMES) | {"torch"} == set(BACKENDS)
    for name, runtime in RUNTIMES.items():
        assert runtime.name == name
        assert runtime.precisions and set(runtime.precisions) <= {"fp32", "bf16", "int8"}
        assert set(runtime.options) <= set(OPTION_DEFAULTS)
    assert CudaGraphRuntime.devices == ("cuda",) and "int8" not in CudaGraphRuntime.precisions
    assert OpenVINORuntime.devices == OnnxRuntimeRuntime.devices == ("cpu",)
    assert OnnxRuntimeRuntime.precisions == ("fp32", "int8")



def test_one_class_per_engine_declares_what_it_offers():
    """Issues 45 and 50: each engine is one runtime class (an `ExportedRuntime`) that owns its name, precisions,
    extra, packages, file names and what it does with them (export, int8, loading): nothing about an engine is
    declared twice, nor in a second class."""
    exported = {name: runtime for name, runtime in RUNTIMES.items() if runtime.exported}
    assert set(exported) == {"openvino", "onnxruntime"}
    for runtime in exported.values():
        assert issubclass(runtime, ExportedRuntime) and runtime.extra and runtime.packages
        for method in ("export", "quantize", "graph_nodes", "load_graph"):
            assert method in vars(runtime), (runtime.name, method)
        assert runtime.file_name("int8") != runtime.file_name("fp32") == runtime.file_name("bf16") == runtime.graph_file


def test_no_engine_is_told_apart_by_its_name_outside_the_registry():
    """What differs between the engines is in their classes: no module of the package compares a backend with an
    engine's name (``backend == "openvino"``)."""
    import re
    from pathlib import Path

    package = Path(registry.__file__).parent
    names = "|".join(name for name, runtime in RUNTIMES.items() if runtime.exported)
    comparison = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = [f"{path.name}:{number}" for path in sorted(package.glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if comparison.search(line)]
    assert found == []


def test_the_options_are_declared_once():
    """Issue 45: `RuntimeOptions` declares the options; `optimize_for_inference`'s signature and every runtime's
    ``options`` come from it, and an unknown option is refused naming the allowed ones."""
    import inspect

    signature = inspect.signature(optimize_for_inference).parameters
    assert {name: signature[name].default for name in OPTION_DEFAULTS} == OPTION_DEFAULTS
    assert set(signature) == {"model", "precision", "backend", *OPTION_DEFAULTS}
    with pytest.raises(ValueError, match=r"`cache_directory`: not an option of optimize_for_inference; its options "
                                         r"are `compile`, `include_text`, `cache_dir`"):
        optimize_for_inference(_vision_model(), "fp32", cache_directory="x")

def test_torch_is_cuda_graphs_on_a_gpu_and_eager_elsewhere():
    assert resolve("torch", "cpu") is TorchEagerRuntime
    assert resolve("torch", "cuda") is CudaGraphRuntime
    assert resolve("torch", "cuda", compile=True) is TorchEagerRuntime  # compile=True asks for compiled blocks
    assert resolve("torch-eager", "cuda") is TorchEagerRuntime
    assert resolve("openvino", "cpu") is OpenVINORuntime
    with pytest.raises(ValueError, match=r"backend='tensorrt' is not supported; allowed values are 'torch', "):
        resolve("tensorrt", "cpu")


def test_auto_precision_is_int8_on_the_cpu_and_bf16_on_a_gpu():
    assert registry.auto_precision("torch", "cpu") == "int8"
    assert registry.auto_precision("openvino", "cpu") == "int8"
    assert registry.auto_precision("torch", "cuda") == "bf16"
    assert registry.auto_precision("torch-eager", "cuda") == "bf16"


def test_auto_on_a_gpu_model_picks_cuda_graphs_in_bf16(monkeypatch):
    # the model's device as optimize_for_inference sees it; no CUDA call happens before the first capture
    for module in (registry, encoder_runtime):  # the choice and the check
        monkeypatch.setattr(module, "device_type", lambda vision_model: "cuda")
    reference = _vision_model()
    model = optimize_for_inference(_vision_model(), "auto")
    settings = model.inference_settings
    assert (settings["runtime"], settings["precision"], settings["backend"]) == ("cuda-graphs", "bf16", "torch")
    assert isinstance(model.runtime, CudaGraphRuntime)
    assert sum(isinstance(m, Bf16Linear) for m in model.modules()) == settings["converted_linears"] > 0
    with torch.no_grad():  # a shape's first call runs eager (the warm-up): the bf16 model's own forward
        got = model(_video())
        expected = optimize_for_inference(reference, "bf16", backend="torch-eager")(_video())
    _assert_same_output(got, expected)
    assert model.runtime.graphs == {}


def test_the_stores_label_names_the_engine_only_for_exported_graphs():
    assert embeddings_label("torch", "bf16", "cuda") == "bf16"
    assert embeddings_label("cuda-graphs", "fp32", "cuda") == "fp32"
    assert embeddings_label("openvino", "int8") == "int8 (openvino)"
    assert isolated_by_default("openvino") and isolated_by_default("onnxruntime")
    assert not isolated_by_default("torch") and not isolated_by_default("torch", "cuda")


# ------------------------------------------------------------------------------------------ refusals, once each


@pytest.mark.parametrize("backend, precision, options, message", [
    ("cuda-graphs", "fp32", {}, r"backend='cuda-graphs' runs on cuda; the model is on cpu\. Backends for cpu: "
                                r"'torch', 'torch-eager', 'openvino', 'onnxruntime'"),
    ("torch", "fp16", {}, r"precision='fp16' is not supported; allowed values are 'fp32', 'bf16', 'int8' and 'auto'"),
    ("torch", "fp32", {"calibration": torch.zeros(1)},
     r"`calibration` is not an option of backend='torch' \(runtime 'torch-eager'\) \(its options: `compile`, "
     r"`include_text`, `fused_kernels`\); backends that take it: 'openvino', 'onnxruntime'"),
    ("torch", "fp32", {"isolate": True}, r"`isolate` is not an option of backend='torch'"),
    ("openvino", "fp32", {"compile": True, "include_text": True},
     r"`compile` and `include_text` are not options of backend='openvino' \(its options: `cache_dir`, "
     r"`calibration`, `isolate`\); backends that take it: 'torch-eager'"),
])
def test_a_refusal_names_the_runtime_the_option_and_the_allowed_values(backend, precision, options, message):
    model = _vision_model()
    with pytest.raises(ValueError, match=message):
        optimize_for_inference(model, precision, backend=backend, **options)
    assert model.runtime is None and getattr(model, "inference_settings", None) is None  # left untouched
    assert not any(isinstance(m, Bf16Linear) for m in model.modules())


def test_precisions_a_device_cannot_run_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"precision='int8' is not offered by backend='cuda-graphs'; allowed values "
                                         r"are 'fp32', 'bf16'"):
        CudaGraphRuntime.check_precision("int8", "cuda")
    with pytest.raises(ValueError, match=r"precision='int8' runs on the CPU only.*model is on cuda.*backend='torch' "
                                         r"\(runtime 'torch-eager'\) there are 'fp32', 'bf16'"):
        TorchEagerRuntime.check_precision("int8", "cuda", backend="torch")
    TorchEagerRuntime.check_precision("int8", "cpu")


# ------------------------------------------------------------------------------------------ the model delegates


def test_the_forward_goes_to_the_runtime_attribute_and_nothing_is_patched():
    model = _vision_model()
    assert model.runtime is None
    optimize_for_inference(model, "bf16")
    assert isinstance(model.runtime, TorchEagerRuntime) and model.runtime.vision_model is model
    assert "forward" not in vars(model)  # the class's forward, which hands the call to `runtime`
    calls = []

    class Recording(TorchEagerRuntime):
        def __call__(self, *args, **kwargs):
            calls.append(kwargs)
            return super().__call__(*args, **kwargs)

    model.runtime = Recording(model, "bf16")
    with torch.no_grad():
        as_tuple = model(_video(), output_hidden_states=True, return_dict=False)
    assert calls == [{"output_hidden_states": True, "output_attentions": False, "trace_source": None}]
    assert isinstance(as_tuple, tuple) and len(as_tuple) >= 3  # return_dict is still the model's own


# ------------------------------------------------------------------------------------------ CUDA graphs, on the CPU


def test_a_shape_is_captured_the_second_time_and_replays_equal_eager(graphs, caplog):
    reference = _vision_model()
    model = optimize_for_inference(_vision_model(), "fp32", backend=graphs)
    runtime = model.runtime
    videos = [_video(seed=s) for s in (1, 2, 3)]
    caplog.set_level(logging.INFO, logger="testa_runtimes.cuda_graphs")
    with torch.no_grad():
        outputs = [model(v, trace_source=True) for v in videos]
        expected = [reference(v, trace_source=True) for v in videos]
    assert runtime.capture.captured == [(2, 8, 3, 32, 32)]  # the first call ran eager, the second captured
    assert runtime.replays == 2 and len(runtime.graphs) == 1
    for got, want in zip(outputs, expected):  # earlier results are copies: later replays did not overwrite them
        _assert_same_output(got, want)
    assert "runs eager: a shape not seen before" in caplog.text and "captured input (2, 8, 3, 32, 32)" in caplog.text
    # without trace_source it is another graph (other outputs), captured on its own second call
    with torch.no_grad():
        for _ in range(2):
            _assert_same_output(model(videos[0]), reference(videos[0]))
    assert len(runtime.graphs) == 2


def test_what_a_graph_cannot_serve_runs_eager_with_the_reason_logged_once(graphs, caplog):
    reference = _vision_model()
    model = optimize_for_inference(_vision_model(), "fp32", backend=graphs)
    runtime = model.runtime
    runtime.max_graphs = 1
    video, other = _video(), _video(batch=1)
    caplog.set_level(logging.INFO, logger="testa_runtimes.cuda_graphs")
    with torch.no_grad():
        model(video), model(video)  # captured
        for _ in range(2):
            got = model(video, output_attentions=True, output_hidden_states=True)
        want = reference(video, output_attentions=True, output_hidden_states=True)
        for _ in range(3):  # another shape: warm-up, then refused by max_graphs
            _assert_same_output(model(other), reference(other))
    assert len(got.hidden_states) == len(want.hidden_states) and len(got.attentions) == len(want.attentions)
    for a, b in zip(got.hidden_states + got.attentions, want.hidden_states + want.attentions):
        assert torch.equal(a, b)
    assert len(runtime.graphs) == 1 and runtime.replays == 1
    assert caplog.text.count("output_hidden_states=True and output_attentions=True: a captured graph returns") == 1
    assert "1 shapes are captured already (max_graphs)" in caplog.text
    # autograd on (weights that require grad): eager, so that gradients flow
    out = model(video)
    assert out.last_hidden_state.requires_grad and "autograd is on" in caplog.text
    assert runtime.replays == 1


def test_changed_aggregation_settings_get_their_own_graph(graphs):
    reference = _vision_model()
    model = optimize_for_inference(_vision_model(), "fp32", backend=graphs)
    video = _video()
    with torch.no_grad():
        model(video), model(video)
        for target in (model, reference):
            target.set_aggregation(spatial_reduction=2)
        for _ in range(2):
            got = model(video, trace_source=True)
        _assert_same_output(got, reference(video, trace_source=True))
    assert len(model.runtime.graphs) == 2



def test_a_graph_keys_on_the_models_score_grid(graphs):
    """Issue 45: the score grid is the model's setting, so `set_aggregation(score_grid=...)` after
    `optimize_for_inference` is another graph (the grid is baked into the captured decisions), which equals the
    eager model under that grid."""
    reference = _vision_model()
    model = optimize_for_inference(_vision_model(), "fp32", backend=graphs)
    video = _video()
    with torch.no_grad():
        model(video), model(video)
        key = model.runtime.key(video, False)
        for target in (model, reference):
            target.set_aggregation(score_grid=0.0)
        assert model.runtime.key(video, False) != key
        for _ in range(2):
            got = model(video, trace_source=True)
        _assert_same_output(got, reference(video, trace_source=True))
    assert len(model.runtime.graphs) == 2


def test_the_fused_kernels_are_the_graph_runtimes_option(graphs):
    """What a graph captures runs the merges as the runtime's ``fused_kernels`` option says (here Triton's
    interpreter, as the CPU stand-in of a GPU), with the same decisions and outputs as the PyTorch path."""
    from modeling_testa import fused_aggregation

    if not fused_aggregation.triton_available():
        pytest.skip("Triton is not installed")
    reference = _vision_model()
    model = optimize_for_inference(_vision_model(), "fp32", backend=graphs, fused_kernels="interpret")
    assert model.runtime.options["fused_kernels"] == "interpret"
    video = _video()
    launches = fused_aggregation.launches
    with torch.no_grad():
        for _ in range(2):  # eager warm-up, then captured: both fused
            got = model(video, trace_source=True)
        expected = reference(video, trace_source=True)
    assert fused_aggregation.launches > launches
    assert torch.equal(got.source_map, expected.source_map) and torch.equal(got.token_sizes, expected.token_sizes)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-5, atol=1e-5)

def test_bf16_graphs_replay_the_bf16_model_and_threads_take_turns(graphs):
    eager = optimize_for_inference(_vision_model(), "bf16", backend="torch-eager")
    model = optimize_for_inference(_vision_model(), "bf16", backend=graphs)
    assert model.inference_settings["converted_linears"] == eager.inference_settings["converted_linears"] > 0
    videos = [_video(seed=s) for s in range(6)]
    with torch.no_grad():
        model(videos[0]), model(videos[0])  # captured
        expected = [eager(v) for v in videos]
    results: dict[int, torch.Tensor] = {}

    def encode(i: int) -> None:
        with torch.no_grad():
            results[i] = model(videos[i]).last_hidden_state

    threads = [threading.Thread(target=encode, args=(i,)) for i in range(len(videos))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, want in enumerate(expected):  # one static buffer, many threads: each got its own video's result
        assert torch.equal(results[i], want.last_hidden_state), i


def test_a_graph_captured_in_inference_mode_serves_calls_outside_it(graphs):
    reference = _vision_model()
    model = optimize_for_inference(_vision_model(), "fp32", backend=graphs)
    videos = [_video(seed=s) for s in range(4)]
    with torch.inference_mode():  # as a pipeline calls it
        model(videos[0]), model(videos[0])  # captured in inference mode
    with torch.no_grad():
        got = [model(v) for v in videos[1:3]]
    with torch.inference_mode():
        got.append(model(videos[3]))
    with torch.no_grad():
        for out, video in zip(got, videos[1:]):
            _assert_same_output(out, reference(video))
    assert model.runtime.replays == 4
