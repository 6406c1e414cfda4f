"""Search a video store built by `train.index` from the command line.

    python -m train.search --store OUT --model FOLDER_OR_HUB_ID "a paragraph" ["another query" ...] \
        [--top-k 10] [--rerank-k K] [--no-rerank] [--group-by-video] [--json] [--filter folder=DIR]
        [--filter dataset=NAME] [--milvus URI [--collection videos] [--milvus-token TOKEN]]

With ``--milvus`` the first stage is the Milvus collection `train.index --milvus` wrote (an embedded Milvus Lite file,
or a server or cluster URI), and the re-ranking tokens are read from the stores its rows name. ``--filter KEY=VALUE``
(repeatable; ``folder``, ``dataset`` or ``video``) keeps only the matching videos.

Ranks through the retrieval pipeline's `search` (`modeling_testa.ranking`), with its defaults, so that this command
and ``pipe.search(query, index)`` give one answer: the cosine of the contrastive embeddings picks the ``rerank_k``
nearest videos (default: the model's ``k_test``), the matching head re-scores them from the stored tokens
(``--no-rerank``: the cosine ranking alone, as ``rerank=False``; for a model whose matching head is not trained to
re-rank, such as the demo's); no video is decoded. Prints one ranked list per query, re-ranked results marked ``*``
(``--json``: a JSON list of lists of ``{"video", "score", "reranked"}``). An index of moments
(``encode_videos(..., window=)`` saved with ``index.save(DIR)``) prints each result's start and end as ``h:mm:ss``
(``"start"``/``"end"`` seconds in JSON); ``--group-by-video`` lists each video once, at its best moment.
"""

import argparse
import json
import sys
from typing import Any

from modeling_testa import TestaProcessor, VideoTextRetrievalPipeline
from testa_search.moments import moment_label
from testa_search.filters import FILTER_KEYS
from testa_search.settings import SETTINGS_FILE, recorded_store_settings
from testa_search.homes import open_index

from testa_search.cli.index import add_milvus_arguments, load_retrieval_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.search", description=__doc__.split("\n\n")[0])
    parser.add_argument("queries", nargs="+", help="sentences or paragraphs to search for")
    parser.add_argument("--store", required=True, help="a store written by `python -m train.index`")
    parser.add_argument("--model", default=None,
                        help="the retrieval model (default: the one the store was built with)")
    parser.add_argument("--top-k", type=int, default=10, help="results per query (default: 10)")
    parser.add_argument("--rerank-k", type=int, default=None, help="candidates re-ranked (default: the model's k_test)")
    parser.add_argument("--no-rerank", action="store_true",
                        help="rank by cosine only (as the pipeline's search(rerank=False); default: re-rank the "
                             "candidates with the matching head, as search() does)")
    parser.add_argument("--group-by-video", action="store_true",
                        help="with an index of moments: each video once, at its best moment")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                        help="only videos whose payload matches (folder=DIR, dataset=NAME, video=PATH; repeatable)")
    add_milvus_arguments(parser, "search this Milvus (file or URI) instead of the store's first stage")
    args = parser.parse_args(argv)
    try:
        args.filters = parse_filters(args.filter)
    except ValueError as error:
        parser.error(str(error))
    if args.top_k < 1 or (args.rerank_k is not None and args.rerank_k < 1):
        parser.error("--top-k and --rerank-k must be at least 1")
    if any(not query.strip() for query in args.queries):
        parser.error("a query is empty")
    return args


def parse_filters(items: list[str]) -> dict[str, list[str]]:
    """``["folder=DIR", "dataset=a", "dataset=b"]`` -> ``{"folder": ["DIR"], "dataset": ["a", "b"]}``; raises
    ValueError naming a malformed item or an unknown key."""
    filters: dict[str, list[str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in FILTER_KEYS or not value:
            raise ValueError(f"--filter {item!r}: use KEY=VALUE with KEY one of {', '.join(FILTER_KEYS)}")
        filters.setdefault(key, []).append(value)
    return filters


def search(store: str, queries: list[str], model: str | None = None, top_k: int = 10, rerank_k: int | None = None,
           rerank: bool | None = None, filters: dict[str, Any] | None = None, milvus: str | None = None,
           collection: str = "videos", group_by_video: bool = False, milvus_token: str | None = None
           ) -> list[list[dict[str, Any]]]:
    """The ranked videos of every query in ``store`` (or in Milvus, see the module docstring). ``rerank``: the
    pipeline's `search` argument (None, its default: re-rank when the index holds tokens; False: cosine only)."""
    index = open_index(store, milvus, collection, milvus_token)
    if model is None:
        settings = recorded_store_settings(store) or {}  # DamagedStoreError naming the file when damaged
        model = settings.get("model") or settings.get("name_or_path")
        if not model:
            raise ValueError(f"--store {store!r} does not say which model built it ({SETTINGS_FILE}): pass --model.")
    retrieval, _ = load_retrieval_model(model)
    pipe = VideoTextRetrievalPipeline(model=retrieval, processor=TestaProcessor.from_pretrained(model), device="cpu")
    results = pipe.search(queries, index, top_k=top_k, rerank=rerank, rerank_k=rerank_k,
                          filters=filters or None, group_by="video" if group_by_video else None)
    return [results] if isinstance(results[0], dict) else results


def main(argv: list[str] | None = None) -> list[list[dict[str, Any]]]:
    args = parse_args(argv)
    try:
        results = search(args.store, args.queries, args.model, args.top_k, args.rerank_k,
                         False if args.no_rerank else None,
                         args.filters, args.milvus, args.collection, args.group_by_video, args.milvus_token)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for query, ranked in zip(args.queries, results):
            print(f"{query}")
            for rank, item in enumerate(ranked, 1):
                print(f"  {rank:3d}. {item['score']:9.4f}{' *' if item['reranked'] else '  '}  {item['video']}"
                      + moment_label(item))
        if any(item["reranked"] for ranked in results for item in ranked):  # the footer says only what happened
            print("(* re-ranked by the matching head)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
