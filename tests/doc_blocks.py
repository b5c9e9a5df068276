"""The fenced code blocks of README.md and docs/, read the way a user copies them.

A block a test runs is marked in the Markdown with `<!-- NAME: tests/... runs this block as written -->`
on the line before its opening fence; `block(page, NAME)` returns its text verbatim. `fenced_blocks(page,
heading)` returns the blocks under a heading, for the ones without a marker (the Quick start commands).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def block(page: str, marker: str) -> str:
    """The code of the fenced block right after `<!-- marker: ... -->` in `page` (relative to the repository)."""
    text = (REPO / page).read_text()
    match = re.search(rf"^<!-- {re.escape(marker)}:[^>]*-->\n```[a-z]*\n(.*?)\n```$", text, re.S | re.M)
    assert match, f"{page} lost its {marker} block (a fenced block right after <!-- {marker}: ... -->)"
    return match.group(1)


def fenced_blocks(page: str, heading: str) -> list[str]:
    """The fenced blocks between the heading `heading` (any level, text exact) and the next heading."""
    text = (REPO / page).read_text()
    match = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", text, re.S | re.M)
    assert match, f"{page} has no heading {heading!r}"
    return re.findall(r"^```[a-z]*\n(.*?)\n```$", match.group(1), re.S | re.M)


def commands(code: str) -> list[str]:
    """A bash block's commands, one per entry: continuation lines (`\\` at the end) joined, comments and blank
    lines left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
