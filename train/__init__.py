"""Accelerate training scripts for TESTA: `pretrain.py`, `finetune_retrieval.py`, `finetune_qa.py`, on the typed
recipe (`recipe.py`), the data pipeline (`data.py`) and the loop (`loop.py`)."""
