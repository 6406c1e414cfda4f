"""Search over videos encoded by a TESTA retrieval model: what uses the model, kept apart from it (a Hub folder
ships `modeling_testa` only).

- `VideoIndex` (`index.py`): the searchable collection (embeddings, the re-ranking tokens, failures), in memory or
  backed by an on-disk video store; `MilvusIndex` (`milvus.py`) serves the first stage from Milvus.
- Where an index lives (`homes.py`: memory, store, Milvus), the store's files and its writer lock (`store/`), the
  settings an index records (`settings.py`) and the payload filters (`filters.py`).
- Building one: `build.IndexBuild` (plan, resume, encode, finish: the one build behind
  `VideoTextRetrievalPipeline.encode_videos` and `python -m train.index`), its encode loop and failure records
  (`encoding.py`) and moments of long videos (`moments.py`).
- The pipeline's `encode_videos` and `search` (`pipeline_methods.py`) and the command lines (`cli/`).

What an application needs (the app in `app/` uses these names only) is exported here: `open_index` (a store, or
its Milvus collection), the rows (`IndexEntry`, `window_entries`), the failure records and encoding stats, and
`moment_frames` / `moment_label`.
"""

from .build import window_entries
from .encoding import EncodingStats, Failure, NoReadableVideoError, is_media_error
from .homes import IndexEntry, SearchableIndex, open_index
from .index import VideoIndex
from .moments import moment_frames, moment_label
from .store.lock import StoreLock, StoreLockedError
from .store.video_store import DamagedStoreError


__all__ = [
    "DamagedStoreError",
    "EncodingStats",
    "Failure",
    "IndexEntry",
    "NoReadableVideoError",
    "SearchableIndex",
    "StoreLock",
    "StoreLockedError",
    "VideoIndex",
    "is_media_error",
    "moment_frames",
    "moment_label",
    "open_index",
    "window_entries",
]
