"""An exported runtime's engine in a process of its own, both sides: the caller's `EngineProcess` and the worker's
request handler (`handler`).

With ``isolate=True`` an exported runtime runs its engine (export, quantization, compilation, inference) in a worker
process, started as the decoder's helper is (`video_decoding.DecoderProcess`): the kit's script run by path,
``python modeling_testa/worker_process.py testa_runtimes/engine_worker.py``, which loads this file by path and serves
its `handler` over pipes with length-prefixed pickles (`worker_process`). A native crash of the engine then kills the
worker only: the caller gets an `EngineProcessError` naming the signal and the worker's log, and the next call starts
a new worker. The app and `train.index` run exported engines this way by default.

The worker imports `modeling_testa` and `testa_runtimes` as the installed packages (or from ``PYTHONPATH``), with
the caller's interpreter and environment; a worker that found another copy of `testa_runtimes` than the caller's is
refused (its graphs could differ).

Requests and replies: ``("init", settings)`` -> ``("ready", the worker's testa_runtimes file)``; ``("encode", pixel_values, trace_source,
aggregation settings)`` -> ``("ok", (last_hidden_state, token_sizes, source_map))``; an error -> ``("error", type
name, message, code)``.
"""

import logging
import os
import sys
import threading
from typing import Any

import torch

from modeling_testa.aggregation_settings import AGGREGATION_FIELDS
from modeling_testa.modeling_testa_vision import TestaVisionModelOutput
from modeling_testa.worker_process import WorkerProcess, read_message, signal_name, write_message


logger = logging.getLogger(__name__)

KIT_MODULE = WorkerProcess.__module__
"""The helper kit's main (`modeling_testa.worker_process`), run as a module (``python -m``) with this file's path.
Not by path, as the decoder helper of a Hub folder is: a script's folder comes first on the import path, where
``modeling_testa/modeling_testa.py`` would shadow the package on Python 3.10 (no PYTHONSAFEPATH there)."""

WORKER_SCRIPT = os.path.abspath(__file__)
"""This file: the handler the kit's script loads by path."""

ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "ImportError": ImportError, "OSError": OSError}
"""The exceptions a worker's error reply is raised as in the caller (by type name; any other: `RuntimeError`)."""


class EngineProcessError(RuntimeError):
    """The engine's worker process died or could not start."""


# ----------------------------------------------------------------------------------------------------------------------
# The caller's side
# ----------------------------------------------------------------------------------------------------------------------


class EngineProcess(WorkerProcess):
    """The caller's side of one engine worker (see the module docstring; the process itself is
    `worker_process.WorkerProcess`'s). Thread-safe (one call at a time); started at the first call, after a crash,
    and anew in a forked child."""

    LOG_TAIL = 2000

    def __init__(self, runtime: Any) -> None:
        super().__init__([sys.executable, "-m", KIT_MODULE, WORKER_SCRIPT], grace=10.0)
        self.runtime = runtime  # an `exported.ExportedRuntime`
        self.lock = threading.Lock()

    def init_message(self) -> dict[str, Any]:
        vision = self.runtime.vision_model
        return {"backend": self.runtime.name, "precision": self.runtime.precision,
                "config": vision.config.to_dict(), "state_dict": {k: v.detach().cpu() for k, v in
                                                                   vision.state_dict().items()},
                "cache_dir": self.runtime.options["cache_dir"], "calibration": self.runtime.options["calibration"],
                "threads": torch.get_num_threads()}

    def start_engine(self) -> None:
        try:
            self.start()
        except (EOFError, OSError, TimeoutError) as error:  # an OSError's message: why the handler did not load
            raise self.died("starting" + (f" ({error})" if str(error) else "")) from error
        reply = self.request(("init", self.init_message()), "starting")
        if reply[0] != "ready":
            raise EngineProcessError(f"the {self.runtime.name} worker did not start: {reply}")
        if reply[1] != sys.modules[__package__].__file__:
            self.stop()
            raise EngineProcessError(f"the {self.runtime.name} worker imported testa_runtimes from {reply[1]}, this "
                                     f"process from {sys.modules[__package__].__file__}: install this checkout "
                                     "(pip install -e .) or put it on PYTHONPATH.")

    def log_tail(self) -> str:
        return self.log_since(max_chars=self.LOG_TAIL).strip()

    def died(self, doing: str) -> EngineProcessError:
        code = self.exit_code(timeout=10)
        tail = self.log_tail()
        self.stop()
        how = f"killed by {signal_name(code)}" if signal_name(code) else (
            f"exit code {code}" if code is not None else "stopped answering")
        return EngineProcessError(
            f"The {self.runtime.name} engine's worker process died while {doing} ({how}); this process is unharmed, "
            "and the next call starts a new worker." + (f" The worker's log ends with: {tail}" if tail else ""))

    def request(self, message: tuple, doing: str) -> tuple:
        try:
            write_message(self.process.stdin.fileno(), message)
            reply = read_message(self.process.stdout.fileno())
        except (EOFError, BrokenPipeError, OSError) as error:
            raise self.died(doing) from error
        if reply[0] == "error":
            raise ERRORS.get(reply[1], RuntimeError)(reply[2])
        return reply

    def encode(self, pixel_values: torch.Tensor, trace_source: bool | None) -> TestaVisionModelOutput:
        vision = self.runtime.vision_model
        vision.check_pixel_values(pixel_values)
        trace = bool(vision.config.trace_source if trace_source is None else trace_source)
        settings = {name: getattr(vision.config, name) for name in AGGREGATION_FIELDS if hasattr(vision.config, name)}
        with self.lock:
            if not self.running():  # not started, died between calls (said, and replaced), or a forked child's
                if self.process is not None:
                    logger.warning("%s", self.died("idle"))
                self.start_engine()
            batch = pixel_values.detach().float().cpu().contiguous()
            reply = self.request(("encode", batch, trace, settings), f"encoding a batch of shape {tuple(batch.shape)}")
        last_hidden_state, token_sizes, source_map = reply[1]
        return TestaVisionModelOutput(last_hidden_state=last_hidden_state, pooler_output=last_hidden_state[:, 0],
                                      token_sizes=token_sizes, source_map=source_map)


# ----------------------------------------------------------------------------------------------------------------------
# The worker's side
# ----------------------------------------------------------------------------------------------------------------------


def _worker_runtime(init: dict[str, Any]) -> Any:
    """The in-process exported runtime the worker runs, from the caller's ``init`` settings."""
    from modeling_testa.configuration_testa import TestaVisionConfig
    from modeling_testa.modeling_testa_vision import TestaVisionModel
    from testa_runtimes.registry import RUNTIMES  # the registry imports the runtimes, which import this module

    torch.set_num_threads(init["threads"])  # the engines use as many threads as PyTorch does in the caller
    vision = TestaVisionModel(TestaVisionConfig(**init["config"])).eval()
    vision.load_state_dict(init["state_dict"])
    return RUNTIMES[init["backend"]](vision, init["precision"], cache_dir=init["cache_dir"],
                                     calibration=init["calibration"])


class EngineRequests:
    """The worker's request handler (the requests and replies are in the module docstring)."""

    def __init__(self) -> None:
        self.runtime = None

    def __call__(self, message: tuple, replies: Any) -> None:
        if message[0] == "init":
            self.runtime = _worker_runtime(message[1])
            replies.send(("ready", sys.modules["testa_runtimes"].__file__))
            return
        _, pixel_values, trace, settings = message
        vision = self.runtime.vision_model
        changed = {k: v for k, v in settings.items() if getattr(vision.config, k) != v}
        if changed:
            vision.set_aggregation(**changed)
        with torch.no_grad():
            out = self.runtime.encode(pixel_values, trace_source=trace)
        replies.send(("ok", (out.last_hidden_state, out.token_sizes, out.source_map)))


def handler() -> EngineRequests:
    """The worker's request handler (`worker_process.main` calls it). Returns at the end of its input (the caller
    closed the pipe or exited); the kit kills it with its caller if an engine call hangs meanwhile."""
    return EngineRequests()


__all__ = ["ERRORS", "KIT_MODULE", "WORKER_SCRIPT", "EngineProcess", "EngineProcessError", "EngineRequests", "handler"]
