"""The documentation holds together: every relative link in README.md and docs/**/*.md points at
a file that exists (and, with a #fragment, at a heading of that file), and every
"docs/spec.md section N" cited anywhere in the repository is a section of docs/spec.md.

Headings become fragments by GitHub's rule (lower case; everything but letters, digits, spaces,
hyphens and underscores dropped; spaces become hyphens), written out here, not taken from a
Markdown library.
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = os.path.join(ROOT, "docs", "spec.md")


SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".ci-venv-cuda", ".pytest_cache",
             "node_modules"}
TEXT_EXTS = (".py", ".md", ".h", ".cpp", ".cu", ".cuh", ".toml", ".txt", ".sh", ".in", ".cfg")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
NUM = r"\d+(?:\.\d+)*"
# "docs/spec.md section 3", "docs/spec.md sections 2.4, 12 and 14", "[docs/spec.md](...) sections 1 to 3"
CITATION = re.compile(
    r"docs/spec\.md(?:\]\([^)]*\))?,?\s+sections?\s+"
    rf"({NUM}(?:(?:\s*,\s*|\s+and\s+|\s*-\s*|\s+to\s+){NUM})*)"
)
SPEC_SECTION = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s")
SPEC_SELF_CITATION = re.compile(
    rf"\bsections?\s+({NUM}(?:(?:\s*,\s*|\s+and\s+|\s*-\s*|\s+to\s+){NUM})*)"
)


def _files(exts, top=ROOT):
    for root, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv"))
        for name in sorted(names):
            if name.endswith(exts):
                yield os.path.join(root, name)


def _markdown_files():
    return [os.path.join(ROOT, "README.md")] + list(_files((".md",), os.path.join(ROOT, "docs")))


def _outside_fences(text):
    """The lines of a Markdown text that are not inside ``` / ~~~ code blocks."""
    inside = False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            yield line


def _slug(heading):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and underscores
    return text.replace(" ", "-")


def _anchors(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    seen, anchors = {}, set()
    for line in _outside_fences(text):
        m = HEADING.match(line)
        if m is None:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for line in _outside_fences(text):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            yield target


def _numbers(listing):
    """'2.4, 12 and 14' -> ['2.4', '12', '14']; '1-3' and '1 to 3' -> ['1', '2', '3']."""
    out = []
    parts = re.split(r"\s*,\s*|\s+and\s+", listing)
    for part in parts:
        m = re.fullmatch(rf"({NUM})(?:\s*-\s*|\s+to\s+)({NUM})", part)
        if m and "." not in m.group(1) and "." not in m.group(2):
            out += [str(i) for i in range(int(m.group(1)), int(m.group(2)) + 1)]
        elif m:
            out += [m.group(1), m.group(2)]
        else:
            out.append(part)
    return out


def _spec_sections():
    with open(SPEC, encoding="utf-8") as f:
        return {m.group(1) for line in _outside_fences(f.read()) if (m := SPEC_SECTION.match(line))}


def test_slug_rule_on_known_headings():
    assert _slug("Narrow optimizer state (`scripts/bench_state_formats.py`)") == (
        "narrow-optimizer-state-scriptsbench_state_formatspy")
    assert _slug("The one-pass step (the default)") == "the-one-pass-step-the-default"
    assert _numbers("2.4, 12 and 14") == ["2.4", "12", "14"]
    assert _numbers("1-3") == ["1", "2", "3"]
    assert _numbers("1 to 3") == ["1", "2", "3"]


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(md):
    missing = []
    for target in _links(md):
        path, _, fragment = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
        rel = os.path.relpath(dest, ROOT)
        if not os.path.exists(dest):
            missing.append(f"{target} (no file {rel})")
            continue
        if fragment and dest.endswith(".md") and fragment not in _anchors(dest):
            missing.append(f"{target} (no heading #{fragment} in {rel})")
    assert not missing, f"{os.path.relpath(md, ROOT)}: broken links: {missing}"


def test_spec_has_the_numbered_sections():
    sections = _spec_sections()
    expected = {str(i) for i in range(0, 16)} | {"2.1", "2.2", "2.3", "2.4", "2.5", "7.1", "7.2", "7.3"}
    assert expected <= sections, f"docs/spec.md lacks sections {sorted(expected - sections)}"


def test_every_cited_spec_section_exists():
    sections = _spec_sections()
    bad = []
    for path in _files(TEXT_EXTS):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        pattern = SPEC_SELF_CITATION if rel == "docs/spec.md" else CITATION
        for m in pattern.finditer(text):
            for number in _numbers(m.group(1)):
                if number not in sections:
                    line = text.count("\n", 0, m.start()) + 1
                    bad.append(f"{rel}:{line}: section {number}")
    assert not bad, f"citations of sections docs/spec.md does not have: {bad}"


def test_no_citation_of_the_old_spec_or_of_tracker_issues():
    """Citations point at docs/spec.md; tracker issue numbers mean nothing outside the project."""
    old = re.compile(r"(?<![\w/])SPEC(?:\.md)?\s+sections?\b|\.\./shared/SPEC\.md")
    issue = re.compile(r"\bissues? [0-9]+", re.IGNORECASE)
    bad = []
    for path in _files(TEXT_EXTS):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel == "tests/test_docs_links.py":
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if old.search(line) or issue.search(line):
                    bad.append(f"{rel}:{lineno}: {line.strip()}")
    assert not bad, f"old citations: {bad}"
