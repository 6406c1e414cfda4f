"""Shared test helpers: tiny models and inputs (`models`), real mp4 files (`videos`), processors and saved
folders for the pipelines (`pipelines`), the retrieval evaluation (`evaluation`), synthetic original TESTA
checkpoints (`original_checkpoints`) and an independent re-statement of the released encoder
(`released_reference`)."""
