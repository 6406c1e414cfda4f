"""A stateful test of the whole index API: random sequences of real operations on a real home, each step checked
against a simple model of what the index must hold (hypothesis' rule-based state machines).

Homes: in memory (`InMemoryHome`, one `VideoIndex` grown in place), a video store (`StoreHome`, reopened from disk
with `VideoIndex.load` after every step, as another process would), and a Milvus collection on a real
`milvus-lite server` (`MilvusHome`). Every operation goes through `build.IndexBuild`, the one build that the
pipeline, `train.index` and the evaluation run.

Operations: build with some videos of a catalog (new ones, the same, a subset, a superset, repeats, unreadable
files); build with another model (refused, nothing changes); a build killed after its first batch (what it wrote is
kept, what it planned is finished by the next build, nothing is encoded twice); a build while another writer holds
the store (refused); search, with and without folder filters over folders whose names hold ``_``, ``%``, quotes,
backslashes, ``/`` and non-ASCII letters.

The reference: the model keeps the videos the index must return, the unreadable ones it must list, and what the
home durably holds; the index must return exactly those rows, each with the embedding its model gives that video
(a deterministic function of model and video), search must equal exact top-k in float64 over the model's rows, and
no row a home already holds may be decoded again, except a row that failed: every build given its video tries it
again (a failure is not a permanent verdict), once the home is finished (a killed build's journaled failures are
resumed first).
"""

import hashlib
import uuid
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from helpers.requirements import require

require("hypothesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test  # noqa: E402

from testa_search.build import IndexBuild  # noqa: E402
from testa_search.homes import IndexEntry, InMemoryHome, StoreHome  # noqa: E402
from testa_search.settings import IndexSettingsError  # noqa: E402
from testa_search.encoding import Failure  # noqa: E402
from testa_search.store.lock import StoreLock, StoreLockedError  # noqa: E402
from testa_search.index import VideoIndex  # noqa: E402

DIM = 8
BATCH = 2
FOLDERS = ["a_1", "aX1", "a%1", "a_10", "a_1/sub", 'q"uote', "back\\slash", "ünï code"]
CATALOG = [f"/data/{folder}/clip{j}.mp4" for folder in FOLDERS for j in range(2)] + [
    "/data/a_1/broken0.mp4", "/data/aX1/broken1.mp4"]
"""Videos in folders that a `like` pattern would confuse (``a_1`` matches ``aX1`` and ``a%1``), and a folder whose
name is a prefix of a sibling's (``a_1``, ``a_10``); the broken ones cannot be read."""
FILTER_FOLDERS = ["/data/a_1", "/data/aX1", "/data/a%1", "/data/a_10", "/data/a_1/sub", '/data/q"uote',
                  "/data/back\\slash", "/data/ünï code", "/data", "/data/"]


class Killed(Exception):
    """The stand-in for a writer killed mid-build."""


def embedding(model: str, video: str) -> torch.Tensor:
    """What `model` encodes `video` to: a unit vector seeded by both (the same whatever the order or batch)."""
    seed = int.from_bytes(hashlib.sha256(f"{model}|{video}".encode()).digest()[:8], "little")
    return torch.nn.functional.normalize(torch.randn(DIM, generator=torch.Generator().manual_seed(seed)), dim=0)


class PassThrough(torch.nn.Module):
    """A stand-in encoder: the decoder's "pixels" are the embedding already; one token per video."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    def get_video_tokens(self, pixel_values: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=pixel_values.unsqueeze(1), token_sizes=None)

    def get_video_features(self, video_tokens: torch.Tensor, video_token_sizes=None) -> SimpleNamespace:
        return SimpleNamespace(pooler_output=video_tokens[:, 0])


def settings_of(model: str) -> dict:
    return {"model_class": "PassThrough", "model_weights_sha256": model, "projection_dim": DIM, "num_frames": 1}


class IndexMachine(RuleBasedStateMachine):
    """The operations and the reference shared by every home; a subclass says how its home is made and opened."""

    failures_recorded = True  # whether the home keeps unreadable rows (Milvus does not: they are retried)

    def __init__(self):
        super().__init__()
        self.encoder = PassThrough()
        self.model: str | None = None  # the model of the home's rows, once a build planned some
        self.rows: set[str] = set()  # the videos search must find
        self.failed: set[str] = set()  # the unreadable videos the index must list
        self.planned: set[str] = set()  # planned by a killed build, finished by the next one
        self.finished = False  # whether the home has a searchable index
        self.held: set[str] = set()  # what the home durably holds: never decoded again (failures: until finished)
        self.decoded: Counter = Counter()

    # -- what each home says -----------------------------------------------------------------------------------------

    def home(self):
        raise NotImplementedError

    def opened(self):
        """The searchable index as a new reader sees it, or None when there is none yet."""
        raise NotImplementedError

    # -- the stand-in decoder ----------------------------------------------------------------------------------------

    def decoder(self, model: str, kill_after: int | None = None, written: list | None = None):
        def decode(entries, positions):
            for batch, start in enumerate(range(0, len(positions), BATCH)):
                if kill_after is not None and batch == kill_after:
                    raise Killed("killed mid-build")
                indices, pixels, failures = [], [], []
                for p in positions[start : start + BATCH]:
                    video = entries[p].name(p)
                    assert video not in self.held, f"{video} is decoded again, though the home holds it"
                    self.decoded[video] += 1
                    if "broken" in video:
                        failures.append(Failure(video, "not_a_video", "the file is not a video", p))
                    else:
                        indices.append(p)
                        pixels.append(embedding(model, video))
                if written is not None:
                    written.extend(entries[p].name(p) for p in positions[start : start + BATCH])
                yield indices, (torch.stack(pixels) if pixels else None), failures

        return decode

    def build(self, model: str, videos: list[str], kill_after: int | None = None, written: list | None = None):
        build = IndexBuild(self.home(), settings_of(model), command="the state machine")
        return build.run(self.encoder, [IndexEntry(video) for video in videos],
                         self.decoder(model, kill_after, written))

    # -- rules -------------------------------------------------------------------------------------------------------

    @rule(videos=st.lists(st.sampled_from(CATALOG), max_size=7), model=st.sampled_from(["A", "A", "A", "B"]))
    def build_with(self, videos, model):
        """A build; with another model than the home's, refused with nothing changed."""
        if self.model is not None and model != self.model:
            with pytest.raises(IndexSettingsError, match="model_weights_sha256"):
                self.build(model, videos)
            return
        given = set(videos) | self.planned
        good, broken = {v for v in given if "broken" not in v}, {v for v in given if "broken" in v}
        if not videos and not self.planned and not self.finished:
            return  # nothing to build (an empty build of a new home is not an index)
        if not good and not self.rows and self.failures_recorded:  # no index holds nothing but failures
            with pytest.raises(ValueError, match="could be read"):
                self.build(model, videos)
            self.unreadable_first_build(model, broken)
            return
        retried, before = self.retried(videos), Counter(self.decoded)
        result = self.build(model, videos)
        assert all(self.decoded[v] > before[v] for v in retried), "a failed video given again was not retried"
        self.model = model
        self.rows |= good
        if self.failures_recorded:
            self.failed |= broken
        self.held |= good
        self.built()
        assert result.report.rows >= len(self.rows)

    def retried(self, videos: list[str]) -> set[str]:
        """The failed videos a build given `videos` tries again: all, once the home is finished (nothing resumed)."""
        return {v for v in videos if v in self.failed} if self.finished and not self.planned else set()

    def built(self) -> None:
        """A build finished: nothing planned is left, and no failure is held (the next build tries it again)."""
        self.planned, self.finished = set(), True
        self.held = {v for v in self.held if "broken" not in v}

    @rule(videos=st.lists(st.sampled_from(CATALOG), min_size=BATCH + 1, max_size=7, unique=True))
    def build_killed_after_one_batch(self, videos):
        """A build killed after its first batch: what it wrote stays, what it planned is the next build's."""
        model = self.model or "A"
        new = [v for v in videos if v not in self.rows and v not in self.failed and v not in self.planned]
        retried = self.retried(videos)
        written: list[str] = []
        try:
            self.build(model, videos, kill_after=1, written=written)
        except Killed:
            pass
        else:  # at most one batch per shard to encode (with what a killed build planned): the build finished
            done = set(new) | self.planned
            self.rows |= {v for v in done if "broken" not in v}
            self.held |= {v for v in done if "broken" not in v}
            if self.failures_recorded:
                self.failed |= {v for v in done if "broken" in v}
            self.model = model
            self.built()
            return
        self.model = model
        self.killed(new, written, retried)

    def killed(self, new: list[str], written: list[str], retried: set[str]) -> None:
        """What a home keeps of a killed build (`new`: the videos it planned; `written`: its first batch;
        `retried`: the failed videos it planned again)."""
        raise NotImplementedError

    def unreadable_first_build(self, model: str, broken: set[str]) -> None:
        """What a home keeps of a first build where no video could be read (refused: no index is published)."""
        raise NotImplementedError

    @rule(k=st.integers(1, 9), folders=st.lists(st.sampled_from(FILTER_FOLDERS), max_size=2),
          seed=st.integers(0, 2**16))
    def search(self, k, folders, seed):
        """First-stage search equals exact top-k over the model's rows passing the filter."""
        index = self.opened()
        if index is not None:
            self.check_search(index, k, folders, seed)

    def check_search(self, index, k: int, folders: list[str], seed: int) -> None:
        query = torch.nn.functional.normalize(torch.randn(1, DIM, generator=torch.Generator().manual_seed(seed)),
                                              dim=1)
        filters = {"folder": folders} if folders else None
        # a video is under a folder when its path starts with the folder and a "/" (written out: not the code's own)
        allowed = sorted(v for v in self.rows if not folders or any(v.startswith(f.rstrip("/") + "/") for f in folders))
        scores, rows = index.nearest(query, k, filters=filters)
        found = [index.entry(int(r))["video"] for r in rows[0] if int(r) >= 0]
        if allowed:
            exact = torch.stack([embedding(self.model, v) for v in allowed]).double() @ query[0].double()
            expected = [allowed[i] for i in exact.topk(min(k, len(allowed))).indices.tolist()]
        else:
            expected = []
        assert found == expected, (filters, found, expected)

    # -- the invariant -----------------------------------------------------------------------------------------------

    @invariant()
    def holds_exactly_the_model(self):
        index = self.opened()
        if index is None:
            assert not self.finished
            return
        names = [index.entry(i)["video"] for i in range(len(index))] if hasattr(index, "valid") else None
        if names is None:  # Milvus: every row, by a query
            rows = {row["video"]: torch.tensor(row["embedding"]) for row in index.all_rows()}
        else:
            valid = index.valid
            rows = {names[i]: index.embeddings[i] for i in range(len(index)) if bool(valid[i])}
        assert set(rows) == self.rows
        for video, vector in rows.items():
            torch.testing.assert_close(vector.float(), embedding(self.model, video), rtol=0, atol=1e-6)
        if self.failures_recorded:
            assert {failure.video for failure in index.failures} == self.failed
        for folder in FILTER_FOLDERS:  # every folder alone: its rows and no other folder's, however it is named
            self.check_search(index, len(CATALOG), [folder], seed=0)


class InMemoryMachine(IndexMachine):
    def __init__(self):
        super().__init__()
        self.index = None

    def home(self):
        return InMemoryHome(store_tokens=True, index=self.index)

    def build(self, model, videos, kill_after=None, written=None):
        result = super().build(model, videos, kill_after, written)
        self.index = result.index
        return result

    def opened(self):
        return self.index

    def killed(self, new, written, retried):  # nothing was written: the index is as it was, its work is lost
        pass

    def unreadable_first_build(self, model, broken):  # no index: nothing is kept
        pass


class StoreMachine(IndexMachine):
    root = None

    @initialize()
    def new_store(self):
        self.directory = self.root / uuid.uuid4().hex

    def home(self):
        return StoreHome(self.directory)

    def opened(self):
        if not (self.directory / "video_store.json").is_file():
            return None
        return VideoIndex.load(self.directory)

    def killed(self, new, written, retried):
        self.planned |= set(new) | retried  # a retried failure left the store's index, and is planned anew
        self.failed -= retried
        self.held |= set(written)  # journaled: the resumed shard skips them

    def unreadable_first_build(self, model, broken):  # planned and journaled, listed once an index is published
        if self.model is None:  # a new store: a build that indexes nothing writes nothing (issue 52)
            return
        self.model = model
        self.failed |= broken | {v for v in self.planned if "broken" in v}
        self.held |= broken | self.planned
        self.planned = set()

    @rule(videos=st.lists(st.sampled_from(CATALOG), min_size=1, max_size=4))
    def build_while_another_writer_holds_the_store(self, videos):
        with StoreLock(self.directory, command="another writer"):
            with pytest.raises(StoreLockedError, match="another writer"):
                self.build(self.model or "A", videos)


class MilvusMachine(IndexMachine):
    failures_recorded = False
    uri = None

    @initialize()
    def new_collection(self):
        self.collection = f"c{uuid.uuid4().hex}"

    def home(self):
        from testa_search.milvus import MilvusHome

        return MilvusHome(self.uri, self.collection)

    def opened(self):
        from testa_search.milvus import MilvusHome

        home = MilvusHome(self.uri, self.collection)
        return home.open() if home.recorded_settings() is not None and self.finished else None

    def killed(self, new, written, retried):  # each batch is upserted as it comes: the first one is there
        good = {v for v in written if "broken" not in v}
        self.rows |= good
        self.held |= good
        self.finished = self.finished or bool(good)


MACHINE_SETTINGS = settings(max_examples=10, stateful_step_count=12, deadline=None, database=None,
                            suppress_health_check=list(HealthCheck), derandomize=True)


def test_in_memory_index(tmp_path):
    run_state_machine_as_test(InMemoryMachine, settings=MACHINE_SETTINGS)


def test_video_store(tmp_path):
    StoreMachine.root = tmp_path
    run_state_machine_as_test(StoreMachine, settings=MACHINE_SETTINGS)


def test_milvus_collection(tmp_path_factory):
    require("pymilvus")
    require("milvus_lite")
    from helpers.milvus_server import milvus_lite_server

    with milvus_lite_server(tmp_path_factory.mktemp("milvus_state")) as uri:
        MilvusMachine.uri = uri
        run_state_machine_as_test(MilvusMachine, settings=MACHINE_SETTINGS)
