"""The search filter language of every index, in one place: what a filter means (`matches`, in Python, for
`VideoIndex`) and the same meaning as a Milvus boolean expression (`milvus_filter`).

A filter is ``{field: value or [values]}``; a row passes when it passes every field, and a field when it equals one
of its values (any of them):

- ``video``: the row's video path, exactly;
- ``folder``: the videos under that folder, subfolders included (``"clips"`` and ``"clips/"`` mean the same; the
  folder's name is taken literally: ``a_1`` never matches ``aX1``, whatever characters it holds);
- ``dataset``: the row's dataset name, exactly.
"""

import json
from typing import Any

FILTER_KEYS = ("video", "folder", "dataset")
"""The payload fields a search filter may name."""


def check_filters(filters: dict[str, Any] | None) -> dict[str, list[str]]:
    """``{field: [values as str]}`` of a filter; raises ValueError naming an unknown field, a value that is not a
    string or a list of strings, or a field with no value."""
    if filters is None:
        return {}
    if not isinstance(filters, dict):
        raise ValueError(f"`filters` must be a dict {{field: value or [values]}} with fields {FILTER_KEYS}, got "
                         f"{type(filters).__name__}.")
    checked = {}
    for key, value in filters.items():
        if key not in FILTER_KEYS:
            raise ValueError(f"Unknown search filter {key!r}; use one of {FILTER_KEYS}.")
        values = [value] if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") else list(value)
        if not values or not all(isinstance(v, str) for v in values):
            raise ValueError(f"The search filter {key!r} takes a string or a non-empty list of strings, got "
                             f"{value!r}.")
        checked[key] = values
    return checked


def folder_prefix(folder: str) -> str:
    """A folder as the prefix of the paths under it (one trailing ``/``; a trailing ``\\`` counts as one)."""
    return str(folder).rstrip("/\\") + "/"


def matches(entry: dict[str, Any], filters: dict[str, Any] | None) -> bool:
    """Whether a row's payload (``video``, ``dataset``) passes the filters."""
    for key, values in check_filters(filters).items():
        if key == "folder":
            if not any(str(entry.get("video", "")).startswith(folder_prefix(v)) for v in values):
                return False
        elif str(entry.get(key)) not in values:
            return False
    return True


def milvus_string(value: str) -> str:
    """A Milvus expression's string literal holding exactly ``value`` (double quotes; JSON escapes, which Milvus'
    expression parser reads)."""
    return json.dumps(str(value), ensure_ascii=False)


def prefix_range(field: str, prefix: str) -> str:
    """``field`` starts with ``prefix``, as a range of strings: ``prefix <= field < prefix'`` where ``prefix'`` is
    ``prefix`` with its last character raised by one. Exact for any characters (a ``like`` pattern would read ``_``
    and ``%`` as wildcards)."""
    upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return f"({field} >= {milvus_string(prefix)} and {field} < {milvus_string(upper)})"


def milvus_filter(filters: dict[str, Any] | None) -> str:
    """The Milvus boolean expression that selects the rows `matches` passes (``""``: every row)."""
    clauses = []
    for key, values in check_filters(filters).items():
        if key == "folder":
            clauses.append("(" + " or ".join(prefix_range("video", folder_prefix(v)) for v in values) + ")")
        else:
            clauses.append(f"{key} in [{', '.join(milvus_string(v) for v in values)}]")
    return " and ".join(clauses)


__all__ = ["FILTER_KEYS", "check_filters", "folder_prefix", "matches", "milvus_filter", "milvus_string",
           "prefix_range"]
