"""The documentation's links hold, and nothing in the repository cites notes a reader cannot open.

Three checks over the whole tree (walked afresh, so new pages are covered the day they land):

- every relative Markdown link in every `*.md` (inline links, images, reference definitions) points
  at a file or folder that exists, and where it has a `#anchor`, at a heading of that file, slugged
  as GitHub slugs headings;
- every `docs/<page>.md[#anchor]` that a source, config or Markdown file mentions names a page that
  exists (and the anchor a heading of it);
- no file cites the project's private design notes by name, a section mark of them, their folder, or
  an issue number: the facts belong in `docs/` (docs/design.md) or in the text itself.

The helpers are tested on small inputs too, so that a check that silently found nothing would fail.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]

# Folders that hold no documentation of the repository's own: VCS and tool state, environments,
# build output, dependencies, and recorded measurement outputs (benchmarks/results/).
SKIP_DIRS = {
    ".git",
    ".venv",
    "venv",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "build",
    "dist",
    "results",
}
# Files whose text can cite something: source, configs, scripts and prose.
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".ini"}
# Files that mention docs/ pages (check b).
MENTION_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml"}

# The private notes, spelled so that this file does not match itself. Names that a page of docs/
# could one day carry are only refused outside docs/ (check b covers those).
OUTSIDE_CITATIONS = re.compile(
    "|".join(
        [
            r"anima[-]model",
            r"ray[-]notes",
            r"(?<![\w/])snapref[-]adapter\.md",
            r"(?<![\w/])architecture\.md",
            r"(?<![\w/])style\.md",
            r"\.\.[/]shared\b",
            r"docs[/]design/",
            "\u00a7",  # the section mark the notes' sections were cited with
            r"(?<![a-z])issue[ _-]?#?\d+",  # also inside test names: test_issue_N_...
        ]
    ),
    re.IGNORECASE,
)
DOCS_MENTION = re.compile(r"(?<![\w./-])(docs/(?:[\w-]+/)*[\w.-]+?\.md)(?!\w)(?:#([\w-]+))?")

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_HTML_ANCHOR = re.compile(r"<a\s+[^>]*?(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_LINE_ANCHOR = re.compile(r"^L\d+(?:-L\d+)?$")


def repository_files(root: Path, suffixes: set[str]) -> Iterator[Path]:
    """Files under `root` with one of `suffixes`, outside SKIP_DIRS and `*.egg-info`, in a stable order."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder, name)
            if path.suffix in suffixes:
                yield path


def prose_lines(markdown: str, *, blank_code_spans: bool = True) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks and HTML comments; code spans blanked
    unless `blank_code_spans` is False (a heading's slug keeps their text)."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    in_comment = False
    for number, line in enumerate(markdown.splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is not None:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = None
            continue
        if opening:
            fence = opening.group(1)
            continue
        text = line
        if in_comment:
            end = text.find("-->")
            if end < 0:
                continue
            text, in_comment = text[end + 3 :], False
        text = re.sub(r"<!--.*?-->", "", text)
        if "<!--" in text:
            text, in_comment = text[: text.index("<!--")], True
        out.append((number, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text) if blank_code_spans else text))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lowercased, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    parts = re.split(r"(`+[^`]*`+)", text)
    rendered = []
    for part in parts:
        if part.startswith("`"):
            rendered.append(part.strip("`"))  # code keeps its characters
        else:
            rendered.append(re.sub(r"(?<!\w)_+|_+(?!\w)", "", part.replace("*", "")))  # emphasis markers
    return re.sub(r"[^\w\- ]", "", "".join(rendered).strip().lower()).replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    """Every anchor a Markdown file offers: its headings' slugs (repeats numbered -1, -2, ... as GitHub
    does) and explicit `<a name=...>` / `<a id=...>` anchors."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    previous = ""
    for _, line in prose_lines(markdown, blank_code_spans=False):
        anchors.update(_HTML_ANCHOR.findall(line))
        atx = _ATX_HEADING.match(line)
        underline = _SETEXT_UNDERLINE.match(line)
        if atx:
            text = atx.group(2)
        elif underline and previous.strip() and not previous.lstrip().startswith(("|", "-", "*", ">", "#")):
            text = previous.strip()
        else:
            previous = line
            continue
        previous = ""
        slug = github_slug(text)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def markdown_links(markdown: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside code."""
    links = []
    for number, line in prose_lines(markdown):
        links += [(number, target) for target in _INLINE_LINK.findall(line)]
        definition = _REFERENCE_DEFINITION.match(line)
        if definition:
            links.append((number, definition.group(1)))
    return links


def _anchors_of(path: Path, cache: dict[Path, set[str]]) -> set[str]:
    if path not in cache:
        cache[path] = heading_anchors(path.read_text(encoding="utf-8"))
    return cache[path]


def link_problem(source: Path, target: str, root: Path, cache: dict[Path, set[str]]) -> str | None:
    """Why a link from `source` to `target` is broken, or None (absolute URLs are not checked)."""
    if not target or _SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part)
    if not path_part:
        resolved = source
    elif path_part.startswith("/"):
        resolved = root / path_part.lstrip("/")
    else:
        resolved = source.parent / path_part
    if not resolved.exists():
        return f"{path_part} does not exist (resolved to {_shown(resolved, root)})"
    if not anchor:
        return None
    if resolved.suffix != ".md":
        if resolved.is_file() and _LINE_ANCHOR.match(anchor):
            return None
        return f"#{anchor}: {_shown(resolved, root)} is not a Markdown page with headings"
    if unquote(anchor).lower() not in _anchors_of(resolved, cache):
        return f"#{anchor} is no heading of {_shown(resolved, root)}"
    return None


def _shown(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def dead_links(root: Path) -> list[str]:
    """`file:line: target: why` for every broken relative link of every Markdown file under `root`."""
    cache: dict[Path, set[str]] = {}
    problems = []
    for page in repository_files(root, {".md"}):
        for number, target in markdown_links(page.read_text(encoding="utf-8")):
            why = link_problem(page, target, root, cache)
            if why:
                problems.append(f"{_shown(page, root)}:{number}: ({target}): {why}")
    return problems


def dead_docs_mentions(root: Path) -> list[str]:
    """`file:line: mention: why` for every `docs/<page>.md[#anchor]` mention whose page or anchor is missing."""
    cache: dict[Path, set[str]] = {}
    problems = []
    for path in repository_files(root, MENTION_SUFFIXES):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in DOCS_MENTION.finditer(line):
                page, anchor = root / match.group(1), match.group(2)
                if not page.is_file():
                    problems.append(f"{_shown(path, root)}:{number}: {match.group(0)}: no such page")
                elif anchor and anchor.lower() not in _anchors_of(page, cache):
                    problems.append(f"{_shown(path, root)}:{number}: {match.group(0)}: no heading #{anchor}")
    return problems


def outside_citations(root: Path) -> list[str]:
    """`file:line: the citation` for every mention of the private notes or of an issue number."""
    problems = []
    for path in repository_files(root, TEXT_SUFFIXES):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            for match in OUTSIDE_CITATIONS.finditer(line):
                problems.append(f"{_shown(path, root)}:{number}: {match.group(0)!r} in: {line.strip()[:160]}")
    return problems


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n  " + "\n  ".join(problems)


# --- the repository -------------------------------------------------------------------------------


def test_every_relative_markdown_link_and_anchor_resolves():
    problems = dead_links(REPO)
    assert not problems, _report(problems, "broken Markdown link(s)")


def test_every_mentioned_docs_page_and_anchor_exists():
    problems = dead_docs_mentions(REPO)
    assert not problems, _report(problems, "mention(s) of a docs/ page or anchor that does not exist")


def test_nothing_cites_the_private_notes_or_issue_numbers():
    problems = outside_citations(REPO)
    assert not problems, _report(
        problems, "citation(s) of notes outside the repository; cite docs/<page>.md#anchor or state the fact"
    )


def test_the_walk_sees_the_documentation():
    pages = {_shown(p, REPO) for p in repository_files(REPO, {".md"})}
    assert {"README.md", "docs/design.md", "docs/adapters.md", "benchmarks/README.md"} <= pages
    assert not any("/results/" in f"/{page}" for page in pages)


# --- the helpers, on inputs whose answers are known ---------------------------------------------------

# Fixture text names its docs/ folder through D, so that the repository check (b) does not read these
# strings of this file as mentions of real pages.
D = "docs"


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Layers", "layers"),
        ("Data flow of a job", "data-flow-of-a-job"),
        ("Storage, the ledger and exactly-once", "storage-the-ledger-and-exactly-once"),
        ("Guidance: CFG, RescaleCFG, APG", "guidance-cfg-rescalecfg-apg"),
        ("SnapRef: cached reference K/V", "snapref-cached-reference-kv"),
        ("Deeper models (28 to 40 blocks)", "deeper-models-28-to-40-blocks"),
        ("`memory_per_worker` and *friends*", "memory_per_worker-and-friends"),
        ("The [render service](docs/design.md) — in short", "the-render-service--in-short"),
        ("ArcAnima v2 and pilot beside SnapRef", "arcanima-v2-and-pilot-beside-snapref"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_anchors_count_repeats_and_ignore_code_blocks():
    page = (
        '# Title\n\n## Setup\n\ntext\n\n## Setup\n\n```\n# not a heading\n```\n\nOther\n-----\n<a id="x1"></a>\n'
        "## `dit_forward.py` — one forward\n"
    )
    assert heading_anchors(page) == {"title", "setup", "setup-1", "other", "x1", "dit_forwardpy--one-forward"}


def test_links_outside_code_only():
    page = (
        f"see [a](a.md#b) and ![i](img.png)\n`[no](x.md)`\n```\n[no](y.md)\n```\n[ref]: {D}/z.md\n<!-- [no](c.md) -->\n"
    )
    assert markdown_links(page) == [(1, "a.md#b"), (1, "img.png"), (6, f"{D}/z.md")]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


def test_dead_link_and_dead_anchor_are_named(tmp_path):
    root = _tree(
        tmp_path,
        {
            "README.md": f"[ok]({D}/a.md#first-part) [ok2](#top) [web](https://x.org/y.md) [bad]({D}/nope.md)\n# Top\n",
            f"{D}/a.md": "# First part\n[up](../README.md) [gone](a.md#second-part) [code](../src/x.py#L3)\n",
            "src/x.py": "",
            "results/r.md": "[ignored](missing.md)\n",
        },
    )
    assert dead_links(root) == [
        f"README.md:1: ({D}/nope.md): {D}/nope.md does not exist (resolved to {D}/nope.md)",
        f"{D}/a.md:2: (a.md#second-part): #second-part is no heading of {D}/a.md",
    ]


def test_docs_mentions_are_checked_with_their_anchors(tmp_path):
    root = _tree(
        tmp_path,
        {
            f"{D}/design.md": "# Memory\n",
            "pkg/m.py": f"# see {D}/design.md#memory and {D}/design.md#cache, {D}/gone.md.\n# ../{D}/rel.md\n",
        },
    )
    assert dead_docs_mentions(root) == [
        f"pkg/m.py:1: {D}/design.md#cache: no heading #cache",
        f"pkg/m.py:1: {D}/gone.md: no such page",
    ]


def test_outside_citations_are_found_by_file_and_line(tmp_path):
    # Each citation is put together here, so that this file holds none of them.
    issue = "iss" + "ue"
    names = ["anima" + "-model.md", "ray" + "-notes.md", f"{D}/" + "design/x.md", "../" + "shared/y"]
    root = _tree(
        tmp_path,
        {
            "a.py": f"# {names[0]} \u00a72.4\nx = 1\n# {names[1]}\n",
            "b.md": f"See {names[2]} and {names[3]}.\n{issue.title()} 12 asked; test_{issue}_23_x; ({issue} #22)\n",
            "c.md": f"{D}/style.md and pytorch/pytorch#133334 and {issue}s in general are fine\n",
        },
    )
    found = [list(re.match(r"(\S+): ('[^']*') in: ", line).groups()) for line in outside_citations(root)]
    assert found == [
        ["a.py:1", repr(names[0].removesuffix(".md"))],
        ["a.py:1", repr("\u00a7")],
        ["a.py:3", repr(names[1].removesuffix(".md"))],
        ["b.md:1", repr(f"{D}/" + "design/")],
        ["b.md:1", repr("../" + "shared")],
        ["b.md:2", repr(f"{issue.title()} 12")],
        ["b.md:2", repr(f"{issue}_23")],
        ["b.md:2", repr(f"{issue} #22")],
    ]
