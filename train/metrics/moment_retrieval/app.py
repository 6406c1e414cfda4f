"""The Hub Space entry point of this metric (a Gradio widget); not used by the library."""

import evaluate
from evaluate.utils import launch_gradio_widget


module = evaluate.load("moment_retrieval")
launch_gradio_widget(module)
