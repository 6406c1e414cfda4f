"""The README stays short and its figures cannot drift from the pages that hold them.

Checks, by parsing the Markdown (no network):

- README.md has at most 250 lines and a "Quick start" with exactly the two commands `make demo` and `make test`;
- every figure of the README's headline table links to a page (a section of it, when the link has an anchor) that
  contains the same figure verbatim, so the one repeated copy cannot silently disagree with its source;
- every relative link (and image) in README.md and docs/*.md points to an existing file, and every `#anchor` to a
  heading of that file;
- the hand-written pages use the module form of the benchmark commands (`python -m benchmarks.<name>`);
- the README's search and fast-inference snippets run as scripts (on a tiny model laid out where `make demo` puts
  its model) and print what the README says: the shell search prints the Python snippet's results.
"""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Pages written by their benchmark scripts: the source of their tables, not edited by hand.
SCRIPT_WRITTEN = {"docs/ablations.md", "docs/tradeoff.md", "docs/frames_vs_compute.md", "docs/frames_vs_compute_raw.md"}

MAX_README_LINES = 250
QUICK_START_COMMANDS = ["make demo", "make test"]
# Headline columns that hold settings rather than measured figures.
SETTING_COLUMNS = {"model", "frames"}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REFERENCE_LINK = re.compile(r"\[([^\]]+)\]\[([^\]]+)\]")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[([^\]]+)\]:\s*(\S+)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def relative(path: Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, in_fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, `_`, `-`, spaces kept),
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[tuple[int, str, int]]:
    """(level, anchor, index into prose_lines) of every heading, with GitHub's -1, -2 suffixes for repeats."""
    found, seen = [], {}
    for index, (_, line) in enumerate(prose_lines(text)):
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            anchor = slug(match.group(2))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.append((len(match.group(1)), anchor if count == 0 else f"{anchor}-{count}", index))
    return found


def section(text: str, anchor: str) -> str:
    """The text under the heading `anchor`, up to the next heading of the same or a higher level."""
    lines = [line for _, line in prose_lines(text)]
    marks = headings(text)
    for position, (level, name, start) in enumerate(marks):
        if name == anchor:
            end = next((i for lvl, _, i in marks[position + 1 :] if lvl <= level), len(lines))
            return "\n".join(lines[start:end])
    raise KeyError(anchor)


def section_by_title(text: str, title: str) -> list[str]:
    """Lines (code blocks included) under the level-2 heading `title`, up to the next level-2 or level-1 heading."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^#{1,2}\s", lines[i])), len(lines))
    return lines[start + 1 : end]


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link, image and reference definition outside code."""
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            found.append((number, definition.group(2)))
            continue
        for match in INLINE_LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match.group(2)))
    return found


def reference_definitions(text: str) -> dict[str, str]:
    return {
        match.group(1).lower(): match.group(2)
        for _, line in prose_lines(text)
        if (match := REFERENCE_DEFINITION.match(line))
    }


def resolve(source: Path, target: str) -> tuple[Path, str]:
    """The file (relative to `source`'s folder) and anchor a relative link points to."""
    file_part, _, anchor = target.partition("#")
    return ((source.parent / file_part).resolve() if file_part else source.resolve()), anchor


def contains_figure(text: str, figure: str) -> bool:
    """`figure` appears verbatim and whole: not as part of a longer number (`17` does not match `0.17` or `170`)."""
    return re.search(r"(?<![\w.])" + re.escape(figure) + r"(?![\w]|\.\d)", text) is not None


# ----------------------------------------------------------------------------------------------------------------------


def test_readme_is_at_most_250_lines():
    count = len(README.read_text(encoding="utf-8").splitlines())
    assert count <= MAX_README_LINES, f"README.md has {count} lines; move details to docs/ (at most {MAX_README_LINES})"


def test_quick_start_has_exactly_the_two_commands():
    lines = section_by_title(README.read_text(encoding="utf-8"), "Quick start")
    commands, in_fence, blocks = [], False, 0
    for line in lines:
        if FENCE.match(line):
            in_fence = not in_fence
            blocks += not in_fence
            continue
        if in_fence:
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    assert blocks == 1, f"the Quick start should have one code block, found {blocks}"
    assert commands == QUICK_START_COMMANDS


def test_search_example_comes_first_and_is_short():
    examples = section_by_title(README.read_text(encoding="utf-8"), "Examples")
    titles = [line[4:].strip() for line in examples if line.startswith("### ")]
    assert titles and titles[0] == "Search a folder of videos", titles
    start = examples.index("### Search a folder of videos")
    fence = [i for i in range(start, len(examples)) if FENCE.match(examples[i])][:2]
    code = [line for line in examples[fence[0] + 1 : fence[1]] if line.strip()]
    assert len(code) <= 8, code


def headline_cells() -> list[tuple[str, str, Path, str]]:
    """(column, figure, page, anchor) for every linked figure of the headline table; fails on an unlinked figure."""
    text = README.read_text(encoding="utf-8")
    references = reference_definitions(text)
    rows = [line for line in section_by_title(text, "Headline numbers") if line.startswith("|")]
    assert len(rows) >= 3, "the README's 'Headline numbers' section has no table"
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    cells = []
    for row in rows[2:]:
        values = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(values) == len(header), row
        for column, value in zip(header, values):
            if column in SETTING_COLUMNS:
                continue
            found = [(fig, references[ref.lower()]) for fig, ref in REFERENCE_LINK.findall(value)]
            found += INLINE_LINK.findall(REFERENCE_LINK.sub("", value))
            rest = INLINE_LINK.sub("", REFERENCE_LINK.sub("", value))
            assert not re.search(r"\d", rest), f"unlinked figure in the headline table ({column}): {value!r}"
            for figure, target in found:
                page, anchor = resolve(README, target)
                cells.append((column, figure, page, anchor))
    return cells


def test_every_headline_figure_is_linked_to_a_page_that_holds_it():
    cells = headline_cells()
    assert len(cells) >= 10, cells
    for column, figure, page, anchor in cells:
        assert page.is_file(), f"{figure!r} ({column}) links to a missing page {page}"
        assert page.parent == DOCS.resolve(), f"{figure!r} ({column}) should cite a page in docs/, not {page}"
        text = page.read_text(encoding="utf-8")
        where = section(text, anchor) if anchor else text
        assert contains_figure(where, figure), (
            f"headline figure {figure!r} ({column}) is not in {relative(page)}{'#' + anchor if anchor else ''}: "
            "update the README's table from that page"
        )


@pytest.mark.parametrize("path", markdown_files(), ids=relative)
def test_relative_links_point_to_existing_files_and_headings(path):
    problems = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:, ...
            continue
        file, anchor = resolve(path, target)
        try:
            name = relative(file)
        except ValueError:
            problems.append(f"line {line}: {target} leaves the repository")
            continue
        if not file.exists():
            problems.append(f"line {line}: {target} -> missing {name}")
            continue
        if anchor and file.suffix == ".md":
            anchors = {a for _, a, _ in headings(file.read_text(encoding="utf-8"))}
            if anchor not in anchors:
                problems.append(f"line {line}: {target} -> no heading '#{anchor}' in {name}")
    assert not problems, f"{relative(path)}:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "path", [p for p in markdown_files() if relative(p) not in SCRIPT_WRITTEN], ids=relative
)
def test_benchmarks_are_shown_as_modules(path):
    text = path.read_text(encoding="utf-8")
    old = re.findall(r"python\s+benchmarks/\w+\.py", text)
    assert not old, f"{relative(path)} uses the script form {old}; write `python -m benchmarks.<name>`"


# ----------------------------------------------------------------------------------------------------------------------
# The README's snippets, run as a user runs them (a tiny model laid out where `make demo` puts its model)


def section_code(title: str, language: str) -> list[str]:
    """The code blocks in `language` under the README heading `### title`, up to the next heading."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(f"### {title}")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^#{1,3}\s", lines[i])), len(lines))
    blocks, current = [], None
    for line in lines[start + 1 : end]:
        if current is None and line.strip() == f"```{language}":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a bash block (continuations joined, comments dropped), split as the shell splits them."""
    import shlex

    return [shlex.split(command, comments=True) for command in block.replace("\\\n", " ").splitlines()
            if command.strip() and not command.lstrip().startswith("#")]


@pytest.fixture()
def demo_layout(tmp_path, monkeypatch):
    """A folder laid out as `make demo` leaves it (a tiny retrieval model, 6 noise videos), the current directory."""
    from helpers.pipelines import build_retrieval, save_folder, tiny_processor
    from helpers.videos import write_noise_video

    save_folder(build_retrieval(), tiny_processor(), tmp_path / "outputs/demo/runs/b/final")
    for i in range(6):
        write_noise_video(tmp_path / "outputs/demo/data/videos" / f"flash{i:05d}.mp4", seed=i)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_search_snippet_prints_its_results_and_the_shell_commands_print_the_same(demo_layout, capsys):
    """The Python snippet, run as a script, prints its five results; the two shell commands (`train.index`, then
    `train.search`, run in this process) print the same videos in the same order, and the footer says "re-ranked"
    only when a result was."""
    from testa_search.cli.index import main as index_main
    from testa_search.cli.search import main as search_main

    title = "Search a folder of videos"
    python, shell = section_code(title, "python"), section_code(title, "bash")
    assert len(python) == 1 and len(shell) == 1
    exec(compile(python[0], "README.md", "exec"), {"__name__": "__main__"})  # noqa: S102 - the README's own code
    printed = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(printed) == 5 and all(len(words) == 2 for words in printed), printed
    snippet_videos = [str(demo_layout / video) for _, video in printed]  # the command names them absolute

    (index, search) = shell_commands(shell[0])
    assert index[:4] == ["accelerate", "launch", "-m", "train.index"] and search[:3] == ["python", "-m", "train.search"]
    index_main([*index[4:], "--num-workers", "0"])
    capsys.readouterr()
    results = search_main(search[3:])
    out = capsys.readouterr().out
    assert [item["video"] for item in results[0]] == snippet_videos
    assert [line.split()[-1] for line in out.splitlines() if re.match(r"^\s+\d+\.", line)] == snippet_videos
    assert "re-ranked" not in out and not any(item["reranked"] for item in results[0])
    reranked = search_main([word for word in search[3:] if word != "--no-rerank"])  # the default: re-rank, as search()
    assert all(item["reranked"] for item in reranked[0]) and "(* re-ranked by the matching head)" in \
        capsys.readouterr().out


def test_the_fast_inference_snippet_runs_without_a_deprecation_warning(demo_layout, recwarn):
    import warnings

    code = section_code("Fast inference", "python")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the legacy int8 path warns FutureWarning
        namespace = {"folder": "outputs/demo/runs/b/final"}
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["pipe"].model.dtype is not None and namespace["model"] is not None
