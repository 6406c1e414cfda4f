"""Accelerate training scripts for TESTA: `pretrain.py`, `finetune_retrieval.py`, `finetune_qa.py` (see loop.py)."""
