"""Every relative link and anchor in the repository's Markdown files points somewhere real.

The Markdown files are the committed ones (`git ls-files '*.md'`). In each, every inline link or
image `[text](target)` and every reference definition `[id]: target` outside fenced code blocks
and inline code is checked: absolute URLs (any `scheme:`, e.g. http:, https:, mailto:) are left
alone; a relative path must name a file or folder that exists and is tracked by git (resolved
from the Markdown file's folder, inside the repository); an anchor, `#name` in the same file or
`file.md#name`, must match a heading of the target file, slugged as GitHub does, or an HTML
`<a name=...>`/`<a id=...>` there.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^ *(`{3,}|~{3,})")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_NOT_PARAGRAPH = re.compile(r"^\s*$|^ {0,3}(?:[#>|]|[-*+][ \t]|\d+[.)][ \t]|<)")
# a code span: a run of backticks, then anything up to the next run of as many (not across a blank line)
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.DOTALL)
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]\\]|\\.|\[[^\[\]]*\])*\]"  # [text] (one level of nested brackets, for images in links)
    r"\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"  # (target or <target>
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"  # optional "title")
)
_REF_DEF = re.compile(r"^ {0,3}\[((?:[^\]\\]|\\.)+)\]:[ \t]*(<[^>\n]*>|\S+)", re.MULTILINE)
_HTML_ANCHOR = re.compile(r"<a\s[^>]*?\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_MD_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (without the duplicate suffix).

    Markdown links keep their text and emphasis markers go, as in the rendered text GitHub slugs;
    then lower-case, every character that is not a letter, digit, `_`, `-` or space removed, and
    each space turned into a hyphen (runs are not collapsed).
    """
    text = _MD_LINK_TEXT.sub(r"\1", heading)
    text = re.sub(r"[*`]", "", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


class Slugger:
    """GitHub's anchors for the headings of one document: a repeated slug gets -1, -2, ..."""

    def __init__(self) -> None:
        self._occurrences: dict[str, int] = {}

    def slug(self, heading: str) -> str:
        original = result = github_slug(heading)
        while result in self._occurrences:
            self._occurrences[original] += 1
            result = f"{original}-{self._occurrences[original]}"
        self._occurrences[result] = 0
        return result


def _blank(match: re.Match[str]) -> str:
    """The matched text with everything but line breaks turned into spaces (offsets stay put)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def strip_fences(text: str) -> str:
    """The text with fenced code blocks blanked out, line for line."""
    out: list[str] = []
    fence: str | None = None
    for line in text.split("\n"):
        opening = _FENCE.match(line)
        if fence is None:
            if opening:
                fence = opening.group(1)
                out.append("")
            else:
                out.append(line)
            continue
        closing = opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence)
        if closing and not line.strip().lstrip(fence[0]):
            fence = None
        out.append("")
    return "\n".join(out)


def strip_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out (offsets and lines stay put)."""
    return _CODE_SPAN.sub(_blank, strip_fences(text))


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown document defines: its headings' slugs and HTML name/id anchors."""
    slugger = Slugger()
    found: set[str] = set()
    lines = strip_fences(text).split("\n")  # headings keep their inline code
    for i, line in enumerate(lines):
        atx = _ATX.match(line)
        if atx:
            found.add(slugger.slug(atx.group(2) or ""))
            continue
        setext = _SETEXT.match(line)
        if setext and i > 0 and not _NOT_PARAGRAPH.match(lines[i - 1]):
            found.add(slugger.slug(lines[i - 1]))
    found.update(_HTML_ANCHOR.findall(strip_code(text)))
    return found


@dataclass(frozen=True)
class Link:
    source: str  # repository-relative path of the Markdown file
    line: int
    target: str


def links(source: str, text: str) -> list[Link]:
    """Every inline link, image and reference definition of a document, outside code."""
    clean = strip_code(text)
    found: list[Link] = []
    for pattern in (_INLINE_LINK, _REF_DEF):
        for match in pattern.finditer(clean):
            target = match.group(2 if pattern is _REF_DEF else 1)
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            line = clean.count("\n", 0, match.start(2 if pattern is _REF_DEF else 1)) + 1
            found.append(Link(source, line, target))
    return sorted(found, key=lambda link: (link.line, link.target))


def _git_files(*pathspec: str) -> list[str]:
    result = subprocess.run(
        ["git", "ls-files", "-z", "--", *pathspec], cwd=REPO, check=True, capture_output=True, text=True
    )
    return [name for name in result.stdout.split("\0") if name]


def broken_links(markdown_files: list[str], tracked: set[str]) -> list[str]:
    """'file:line -> target (why)' for every broken relative link of the given Markdown files."""
    tracked_dirs = {parent.as_posix() for name in tracked for parent in Path(name).parents}
    anchor_cache: dict[str, set[str]] = {}

    def anchors_of(rel: str) -> set[str]:
        if rel not in anchor_cache:
            anchor_cache[rel] = anchors((REPO / rel).read_text(encoding="utf-8"))
        return anchor_cache[rel]

    problems: list[str] = []
    for source in markdown_files:
        text = (REPO / source).read_text(encoding="utf-8")
        for link in links(source, text):
            target = link.target
            if not target:
                problems.append(f"{source}:{link.line} -> (empty target)")
                continue
            if _SCHEME.match(target):
                continue  # an absolute URL
            path_part, _, fragment = target.partition("#")
            path_part = unquote(path_part.split("?", 1)[0])
            if path_part.startswith("/"):
                problems.append(f"{source}:{link.line} -> {target} (absolute path; use a relative one)")
                continue
            if path_part:
                resolved = (REPO / source).parent / path_part
                try:
                    rel = resolved.resolve().relative_to(REPO).as_posix()
                except ValueError:
                    problems.append(f"{source}:{link.line} -> {target} (outside the repository)")
                    continue
                if not resolved.exists():
                    problems.append(f"{source}:{link.line} -> {target} (no such file)")
                    continue
                if rel not in tracked and rel not in tracked_dirs:
                    problems.append(f"{source}:{link.line} -> {target} (not tracked by git)")
                    continue
            else:
                rel = source
            if fragment and rel.lower().endswith(".md") and (REPO / rel).is_file():
                if unquote(fragment) not in anchors_of(rel):
                    problems.append(f"{source}:{link.line} -> {target} (no heading #{fragment} in {rel})")
    return problems


def test_relative_links_and_anchors_resolve() -> None:
    markdown_files = _git_files("*.md")
    assert "README.md" in markdown_files, "git ls-files found no README.md: is this a checkout?"
    problems = broken_links(markdown_files, set(_git_files()))
    assert not problems, f"{len(problems)} broken Markdown link(s):\n" + "\n".join(problems)


def test_github_slug() -> None:
    assert github_slug("A whole run on a real trace") == "a-whole-run-on-a-real-trace"
    assert github_slug("`bench goodput`: 3 variants") == "bench-goodput-3-variants"
    assert github_slug("Fast joins on GCE: `--standby`") == "fast-joins-on-gce---standby"
    assert github_slug("Any MPI program (mpi4py + numpy, no Horovod)") == "any-mpi-program-mpi4py--numpy-no-horovod"
    assert github_slug("GPU VMs (NCCL)") == "gpu-vms-nccl"
    assert github_slug("snake_case and [a link](x.md)") == "snake_case-and-a-link"
    assert github_slug("Übersicht, café") == "übersicht-café"


def test_duplicate_headings_get_numbered() -> None:
    slugger = Slugger()
    assert [slugger.slug(h) for h in ("Results", "Results", "results", "Results 1")] == [
        "results",
        "results-1",
        "results-2",
        "results-1-1",
    ]
    text = "# Bench\n\n## Results\n\n```md\n## Results\n```\n\n## Results\n\nTitle\n=====\n"
    assert anchors(text) == {"bench", "results", "results-1", "title"}


def test_links_skip_code_and_find_every_form() -> None:
    text = (
        "See [a](a.md#x) and ![img](../b.png \"t\").\n"
        "`[not](code.md)` and ``[nor `this`](x.md)``\n"
        "```\n[in](fence.md)\n```\n"
        "[multi\nline](c.md)\n"
        "[ref]: d.md#y\n"
        "<https://example.com> [web](https://example.com) [mail](mailto:a@b.c)\n"
    )
    got = [(link.line, link.target) for link in links("doc.md", text)]
    assert got == [
        (1, "../b.png"),
        (1, "a.md#x"),
        (7, "c.md"),
        (8, "d.md#y"),
        (9, "https://example.com"),
        (9, "mailto:a@b.c"),
    ]
