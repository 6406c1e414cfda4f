"""TESTA inside the vision towers of transformers' video-LLMs (issue 51): one adapter per model family."""
