"""The training data: rows of a split, decoded and tokenised in DataLoader workers, shared between processes.

- `load_rows`: any split ``datasets`` reads (our jsonl/parquet folders, a Hub id), streamed or not;
- `VideoTextCollator`: decodes and samples the videos, tokenises the texts; undecodable videos are replaced from a
  reservoir of recent good samples (`DecodeFailures` when nothing decodes);
- `epoch_loader`: one process's DataLoader for an epoch, reshuffled every epoch, shared between processes by
  position (`StreamedEpoch` for streams), resumable exactly from a saved position;
- `synchronized`: stops every process when one runs out;
- `collective`: a collective that waited past ``train.collective_timeout`` (or whose peer died) raises
  `CollectiveTimeout`, naming the process, the step and what it waited for;
- `build_processor`: the `TestaProcessor` of the recipe's ``data`` section.
"""

import collections
import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from modeling_testa.process_start import dataloader_workers
from processing.data import load_split

from .recipe import Recipe, as_recipe


def build_processor(recipe: "Recipe | Mapping"):
    """The `TestaProcessor` of the recipe's ``data`` section (frames, size, decoder); a mapping may be partial, e.g.
    ``{"data": {"num_frames": 8}}``."""
    from modeling_testa.processing_testa import TestaProcessor
    from modeling_testa.video_processing_testa import TestaVideoProcessor

    data = as_recipe(recipe).data
    size = data.image_size
    video_processor = TestaVideoProcessor(
        num_frames=data.num_frames, size={"shortest_edge": size}, crop_size={"height": size, "width": size},
        video_backend=data.video_backend, isolate_decoder=data.isolate_decoder,
    )
    return TestaProcessor(video_processor=video_processor)


def load_rows(recipe: "Recipe | Mapping", split: str, task: str, streaming: bool):
    """One split as a `datasets` dataset: one of our folders/files, or anything `load_dataset` reads (Hub ids), from
    the recipe's ``data.dataset``."""
    import datasets

    location = recipe["data"].get("dataset")
    if not location:
        raise ValueError("no dataset: set data.dataset in the recipe or pass --dataset")
    if isinstance(location, (list, tuple)):  # e.g. WebVid + CC3M for pretraining
        parts = [load_rows({"data": {"dataset": item}}, split, task, streaming) for item in location]
        return datasets.interleave_datasets(parts) if streaming else datasets.concatenate_datasets(parts)
    if os.path.exists(location):
        return load_split(location, split=split, task="qa" if task == "qa" else "retrieval", streaming=streaming)
    return datasets.load_dataset(location, split=split, streaming=streaming)


class DecodeFailures(RuntimeError):
    """No decodable video was found for a batch (its own rows, the reservoir and the spare rows all failed)."""


# Exceptions that mean "this file is missing, corrupt or undecodable": the video processor raises
# `VideoDecodingError` (a ValueError) for every decoder failure, missing files and unreadable images are OSErrors.
# Anything else is a bug and is raised. The evaluation uses the same tuple.
MEDIA_ERRORS = (OSError, ValueError)


class VideoTextCollator:
    """Turns rows into a batch in a DataLoader worker: decodes and samples the videos, tokenises the texts.

    A training batch never dies of bad videos: a row whose video fails to decode is replaced by a recent good sample
    (video and texts together, so the pair stays consistent) from a small reservoir kept by this worker, and counted
    (``stats["failures"]``), so that batch shapes stay equal on every process. While the reservoir is still empty
    (the first batches), the `spare_rows` (a few rows of the split) are decoded to fill it. With `strict` the error is
    raised instead. Frame sampling is seeded per example (seed, epoch, position in the epoch's global order), so a
    resumed run sees exactly the frames an uninterrupted run would and two processes never share a seed.

    Args:
        text_lengths: the text columns to tokenise and their padded length, e.g. ``{"text": 64}`` or
            ``{"question": 35, "answer": 10}``. The first one becomes ``input_ids``/``attention_mask``, the others
            ``<name>_input_ids``/``<name>_attention_mask``.
        reservoir_size: how many recent good samples a worker keeps as replacements.
        spare_rows: rows to decode when a replacement is needed and the reservoir is empty.
    """

    def __init__(self, processor, text_lengths: dict[str, int], sampling: str, num_frames: int, seed: int,
                 strict: bool, reservoir_size: int = 8, spare_rows: list[dict] | tuple = ()):
        self.processor = processor
        self.text_lengths = text_lengths
        self.sampling = sampling
        self.num_frames = num_frames
        self.seed = seed
        self.strict = strict
        self.reservoir: collections.deque = collections.deque(maxlen=max(1, int(reservoir_size)))
        self.spare_rows = list(spare_rows)

    def decode(self, row: dict) -> torch.Tensor:
        example_seed = (self.seed * 1_000_003 + row.get("epoch", 0) * 10_007 + row.get("position", 0)) % 2**31
        if row.get("video") is not None:
            return self.processor.video_processor(
                videos=[row["video"]], num_frames=self.num_frames, frame_sampling=self.sampling, seed=example_seed
            )["pixel_values"][0]
        if row.get("image") is None:
            raise ValueError(f"row {row.get('position')} has neither a 'video' nor an 'image' value: {sorted(row)}")
        from PIL import Image

        with Image.open(row["image"]) as image:  # image-text pairs become static videos
            frames = [image.convert("RGB")] * self.num_frames
        return self.processor.video_processor(videos=[frames], do_sample_frames=False)["pixel_values"][0]

    @staticmethod
    def _key(row: dict) -> str:
        return str(row.get("video_id") or row.get("video") or row.get("image"))

    def _replacements(self, count: int, taken: set[str], failures: list[str]) -> list[tuple[torch.Tensor, dict]]:
        """`count` recent good samples, distinct and not already in the batch when the reservoir allows (a batch of
        one repeated video has no hard negative); spare rows are decoded while the reservoir holds too few."""
        def distinct() -> int:
            return sum(self._key(row) not in taken for _, row in self.reservoir)

        while distinct() < min(count, self.reservoir.maxlen) and self.spare_rows:
            row = self.spare_rows.pop(0)
            try:
                self.reservoir.append((self.decode(row), row))
            except MEDIA_ERRORS as error:
                failures.append(f"spare row {row.get('video') or row.get('image')}: {error}")
        if not self.reservoir:
            raise DecodeFailures(
                "no decodable video for this batch: its videos, the reservoir of recent good samples (empty) and the "
                "spare rows all failed:\n" + "\n".join(failures))
        newest_first = list(reversed(self.reservoir))
        ranked = [s for s in newest_first if self._key(s[1]) not in taken] + [
            s for s in newest_first if self._key(s[1]) in taken]
        return [ranked[i % len(ranked)] for i in range(count)]

    def __call__(self, rows: list[dict]) -> dict:
        start = time.perf_counter()
        samples, failures = [], []
        for row in rows:
            try:
                video = self.decode(row)
            except MEDIA_ERRORS as error:  # missing, corrupt or undecodable media
                if self.strict:
                    raise
                failures.append(f"{row.get('video') or row.get('image')}: {type(error).__name__}: {error}")
                samples.append(None)
                continue
            samples.append((video, row))
        good = [sample for sample in samples if sample is not None]
        failed = [i for i, sample in enumerate(samples) if sample is None]
        # The batch's own good samples join the reservoir first: a batch with one good video never fails, even
        # while the reservoir is empty and the spare rows fail (other videos are still preferred as replacements).
        self.reservoir.extend(good)
        if failed:
            taken = {self._key(row) for _, row in good}
            for i, sample in zip(failed, self._replacements(len(failed), taken, failures)):
                samples[i] = sample
        batch = {"pixel_values": torch.stack([video for video, _ in samples])}
        rows = [row for _, row in samples]
        for position, (name, length) in enumerate(self.text_lengths.items()):
            encoded = self.processor.tokenizer(
                [row[name] for row in rows], padding="max_length", truncation=True, max_length=length,
                return_tensors="pt",
            )
            prefix = "" if position == 0 else f"{name}_"
            batch[f"{prefix}input_ids"] = encoded["input_ids"]
            batch[f"{prefix}attention_mask"] = encoded["attention_mask"]
        batch["video_key"] = [self._key(row) for row in rows]
        batch["stats"] = {"decode_seconds": time.perf_counter() - start, "videos": len(rows), "failures": failures,
                          "replaced": len(failed)}
        return batch


class _Positioned(torch.utils.data.Dataset):
    """A map-style share of a split with each row's position in the epoch's global order attached (per-example
    seeds), starting at `offset`."""

    def __init__(self, rows, epoch: int, offset: int, first_position: int):
        self.rows, self.epoch, self.offset, self.first_position = rows, epoch, offset, first_position

    def __len__(self) -> int:
        return len(self.rows) - self.offset

    def __getitem__(self, index: int) -> dict:
        index += self.offset
        return {**self.rows[index], "position": self.first_position + index, "epoch": self.epoch}


def _iterate_rows(stream, chunk: int = 256):
    """The rows of a `datasets.IterableDataset`, read with `.iter()`: plain iteration inside a DataLoader worker
    would make datasets split the shards between workers itself, which `StreamedEpoch` does by position."""
    for columns in stream.iter(batch_size=chunk):
        names = list(columns)
        for i in range(len(columns[names[0]]) if names else 0):
            yield {name: columns[name][i] for name in names}


class StreamedEpoch(torch.utils.data.IterableDataset):
    """One process's batches of rows of a streamed (`datasets.IterableDataset`) split for one epoch, resumable
    exactly on any number of processes and DataLoader workers.

    The epoch's global order is ``rows.shuffle(seed, buffer_size)`` with ``set_epoch(epoch)`` set on the very dataset
    that is iterated (shard order and shuffle buffer change every epoch). Global row ``g`` belongs to process
    ``g % world``; that process's ``j``-th row (``j = g // world``) belongs to its batch ``j // batch_size``. Batches
    before `start_batch` (already trained on) are skipped, and worker ``w`` of ``W`` yields the batches ``b`` with
    ``(b - start_batch) % W == w``, which is the order in which a DataLoader takes them. So the batches, their order
    and every row's position (the per-example seed) depend only on (seed, epoch, rank, world, batch_size), not on
    where a run was interrupted, nor on the number of shards or workers. Each process (and worker) reads the rows'
    metadata of the whole stream and keeps its share; only kept rows are decoded.

    datasets' own ``IterableDataset.state_dict()`` is not used: it loses the shuffle buffer's content on resume (so
    the resumed order differs) and needs a stateful DataLoader to track positions across workers.
    """

    def __init__(self, rows, seed: int, epoch: int, rank: int, world: int, batch_size: int, start_batch: int = 0,
                 buffer_size: int = 1000):
        self.rows, self.seed, self.epoch = rows, seed, epoch
        self.rank, self.world, self.batch_size, self.start_batch = rank, world, batch_size, start_batch
        self.buffer_size = buffer_size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        stream = self.rows.shuffle(seed=self.seed, buffer_size=self.buffer_size)
        stream.set_epoch(self.epoch)
        batch: list[dict] = []
        for position, row in enumerate(_iterate_rows(stream)):
            if position % self.world != self.rank:
                continue
            index = (position // self.world) // self.batch_size
            if index < self.start_batch or (index - self.start_batch) % workers != worker:
                continue
            batch.append({**row, "position": position, "epoch": self.epoch})
            if len(batch) == self.batch_size:
                yield batch
                batch = []


def epoch_loader(rows, state, per_device_batch: int, seed: int, rank: int, world: int,
                 collator, workers: int, buffer_size: int = 1000) -> DataLoader:
    """This process's DataLoader for the current epoch, shuffled with (seed, epoch), from the saved position on.

    ``state`` is the loop's `TrainState` (its ``epoch`` and ``micro_batches_in_epoch`` are read). Every process
    consumes the same number of rows per step, so the saved position (micro-batches into the epoch)
    is the same on all of them. Its workers start from a forkserver, never by forking this process, which runs
    threads by then (`modeling_testa.process_start.dataloader_workers`).
    """
    from datasets import IterableDataset

    start = state.micro_batches_in_epoch
    # Its own generator: creating the loader must not draw from the global RNG, which a resumed run restores.
    generator = torch.Generator().manual_seed(seed + state.epoch)
    if isinstance(rows, IterableDataset):
        epoch_data = StreamedEpoch(rows, seed, state.epoch, rank, world, per_device_batch, start, buffer_size)
        return DataLoader(epoch_data, batch_size=None, collate_fn=collator, num_workers=workers, generator=generator,
                          **dataloader_workers(workers, epoch_data, collator))
    per_process = len(rows) // world  # equal shares on every process
    shard = rows.shuffle(seed=seed + state.epoch).select(range(rank * per_process, (rank + 1) * per_process))
    epoch_data = _Positioned(shard, state.epoch, min(start * per_device_batch, per_process), rank * per_process)
    return DataLoader(epoch_data, batch_size=per_device_batch, collate_fn=collator, num_workers=workers,
                      drop_last=True, generator=generator, **dataloader_workers(workers, epoch_data, collator))


def spare_rows(rows, count: int) -> list[dict]:
    """The first `count` rows of the split: decoded to fill an empty reservoir (see `VideoTextCollator`)."""
    from datasets import IterableDataset

    if isinstance(rows, IterableDataset):
        return list(itertools.islice(_iterate_rows(rows), count))
    return [rows[i] for i in range(min(count, len(rows)))]


class CollectiveTimeout(RuntimeError):
    """A process waited for the others longer than the process group's timeout (``train.collective_timeout``), or
    another process died while it waited: the message names this process, the step and what it waited for."""


@contextlib.contextmanager
def collective(accelerator: Accelerator, what: str, where: "str | Callable[[], str]" = "") -> Iterator[None]:
    """Runs the collective in the block; the process group's error (a timeout, a peer that died: RuntimeErrors
    with the backend's words) becomes a `CollectiveTimeout` naming this process, `where` (e.g. ``"before step 3
    (epoch 1)"``; a function is called only on failure) and `what` it waited for."""
    try:
        yield
    except CollectiveTimeout:
        raise
    except RuntimeError as error:
        place = where() if callable(where) else where
        raise CollectiveTimeout(
            f"process {accelerator.process_index} of {accelerator.num_processes} gave up waiting for {what}"
            f"{' ' + place if place else ''}: another process is stuck or has died (the limit is "
            f"train.collective_timeout). {type(error).__name__}: {str(error).strip()[:500]}") from error


def synchronized(loader, accelerator: Accelerator, where: "str | Callable[[], str]" = ""):
    """Yields the loader's batches until any process runs out: every process must take the same number of steps,
    since the losses gather across processes. A process that waits too long for the others' batches raises
    `CollectiveTimeout` (`collective`; `where` names the step)."""
    iterator = iter(loader)
    while True:
        batch = next(iterator, None)
        has_batch = torch.tensor([0 if batch is None else 1], device=accelerator.device)
        with collective(accelerator, "the other processes' next batch (all_reduce in train.data.synchronized)", where):
            others = accelerator.reduce(has_batch, reduction="sum").item()
        if others < accelerator.num_processes:
            return
        yield batch


def move_to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


__all__ = [
    "MEDIA_ERRORS",
    "CollectiveTimeout",
    "DecodeFailures",
    "StreamedEpoch",
    "VideoTextCollator",
    "build_processor",
    "collective",
    "epoch_loader",
    "load_rows",
    "move_to_device",
    "spare_rows",
    "synchronized",
]
