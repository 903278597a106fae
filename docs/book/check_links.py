#!/usr/bin/env python3
"""Checks the guide's internal links and includes; exits non-zero naming each broken one.

For every Markdown file under docs/book/src (and the repository's README.md):
- every `{{#include PATH}}`, `{{#include PATH:ANCHOR}}`, `{{#include PATH:START:END}}` and
  `{{#rustdoc_include ...}}`: the file exists, an anchor has both its `ANCHOR: name` and
  `ANCHOR_END: name` lines, and a line range lies within the file;
- every relative link and image, inline (`[text](target)`) or by reference
  (`[label]: target`): the target exists, and a `#fragment` names a heading of the target
  page (or of this page, for a bare `#fragment`).

Links with a scheme (`https:`, `mailto:`) are not followed. Links inside code spans and fenced
code blocks are not links. Heading ids follow mdBook's rule: lower-case letters, digits, `_`
and `-` kept, white space turned into `-`, everything else dropped, and a repeated id numbered
`-1`, `-2`, …; an included Markdown file's headings count as the including page's.

Standard library only: `python3 docs/book/check_links.py` from anywhere.
"""

import os
import re
import sys

BOOK_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src")
REPO = os.path.normpath(os.path.join(BOOK_SRC, "..", "..", ".."))

INCLUDE = re.compile(r"\{\{#(include|rustdoc_include)\s+([^}\s]+)\s*\}\}")
INLINE_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def without_code(text, keep_spans=False):
    """The text with fenced code blocks blanked out line by line, and code spans removed
    (kept with `keep_spans`, for headings)."""
    out, fence = [], None
    for line in text.split("\n"):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and marker:
            fence = marker.group(1)[0] * len(marker.group(1))
            out.append("")
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            out.append("")
            continue
        out.append(line if keep_spans else re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return "\n".join(out)


def heading_text(raw):
    """A heading's text as rendered: links and images become their text, markup goes."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("*", "")


def normalize_id(text):
    out = []
    for ch in text:
        if ch.isalnum() or ch in "_-":
            out.append(ch.lower())
        elif ch.isspace():
            out.append("-")
    return "".join(out)


def expanded(path, seen=()):
    """The page's Markdown with included Markdown files spliced in (for their headings)."""
    text = read(path)

    def splice(m):
        target = m.group(2).split(":")[0]
        full = os.path.normpath(os.path.join(os.path.dirname(path), target))
        if target.endswith(".md") and os.path.isfile(full) and full not in seen:
            return expanded(full, seen + (full,))
        return ""

    return INCLUDE.sub(splice, text)


_ids = {}


def heading_ids(path):
    if path not in _ids:
        ids, counts = set(), {}
        for line in without_code(expanded(path), keep_spans=True).split("\n"):
            m = HEADING.match(line)
            if not m:
                continue
            base = normalize_id(heading_text(m.group(2)))
            n = counts.get(base, 0)
            counts[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
        _ids[path] = ids
    return _ids[path]


def check_include(page, kind, spec, problems):
    parts = spec.split(":")
    target = os.path.normpath(os.path.join(os.path.dirname(page), parts[0]))
    where = f"{os.path.relpath(page, REPO)}: {{{{#{kind} {spec}}}}}"
    if not os.path.isfile(target):
        problems.append(f"{where}: no file {os.path.relpath(target, REPO)}")
        return
    rest = parts[1:]
    if not rest or rest == [""]:
        return
    lines = read(target).split("\n")
    if all(p.isdigit() or p == "" for p in rest):
        numbers = [int(p) for p in rest if p]
        if any(n < 1 or n > len(lines) for n in numbers):
            problems.append(f"{where}: {os.path.relpath(target, REPO)} has {len(lines)} lines")
        return
    anchor = rest[0]
    start = re.compile(r"ANCHOR:\s*" + re.escape(anchor) + r"\b")
    end = re.compile(r"ANCHOR_END:\s*" + re.escape(anchor) + r"\b")
    if not any(start.search(line) for line in lines):
        problems.append(f"{where}: no `ANCHOR: {anchor}` in {os.path.relpath(target, REPO)}")
    if not any(end.search(line) for line in lines):
        problems.append(f"{where}: no `ANCHOR_END: {anchor}` in {os.path.relpath(target, REPO)}")


def check_link(page, target, problems):
    if SCHEME.match(target) or target.startswith("//"):
        return
    where = f"{os.path.relpath(page, REPO)}: link {target}"
    path, _, fragment = target.partition("#")
    full = page if path == "" else os.path.normpath(os.path.join(os.path.dirname(page), path))
    if not os.path.exists(full):
        problems.append(f"{where}: no file {os.path.relpath(full, REPO)}")
        return
    if fragment and full.endswith(".md") and fragment not in heading_ids(full):
        problems.append(f"{where}: {os.path.relpath(full, REPO)} has no heading #{fragment}")


def check_page(page, problems):
    text = read(page)
    for m in INCLUDE.finditer(text):
        check_include(page, m.group(1), m.group(2), problems)
    prose = without_code(INCLUDE.sub("", text))
    for m in INLINE_LINK.finditer(prose):
        check_link(page, m.group(1), problems)
    for line in prose.split("\n"):
        m = REFERENCE_DEF.match(line)
        if m:
            check_link(page, m.group(1), problems)


def main():
    pages = [os.path.join(REPO, "README.md")]
    for root, _, files in os.walk(BOOK_SRC):
        pages += [os.path.join(root, f) for f in sorted(files) if f.endswith(".md")]
    problems = []
    for page in pages:
        check_page(page, problems)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_links: {len(problems)} broken link(s) or include(s)", file=sys.stderr)
        return 1
    print(f"check_links: {len(pages)} pages, every link and include resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
