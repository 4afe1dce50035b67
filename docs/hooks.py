"""MkDocs hook: the benchmarks' results become pages of the site, read where the benchmark
scripts write them, so that the site never shows a stale copy.

- ``benchmarks/results/*.md`` and their ``*.png`` plots are published under
  ``benchmarks/results/`` (a results file without a page in ``mkdocs.yml``'s nav fails
  ``mkdocs build --strict``: ``validation.omitted_files``); a plot its page does not show
  (``cpu.png``) is added at the page's end.
- ``<!-- results table -->`` in ``benchmarks.md`` becomes a table of every results file: its
  title, and the machine, commit and date its own header states: the first of each in the
  file, which in the re-run logs (newest first) is their newest entry's; "not stated" where
  the file states none.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

PLACEHOLDER = "<!-- results table -->"


def _results(config) -> Path:
    return Path(config.config_file_path).parent / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    for path in sorted(_results(config).iterdir()):
        if path.suffix in (".md", ".png") and not path.stem.endswith("-quick"):
            files.append(File.generated(config, f"benchmarks/results/{path.name}", abs_src_path=str(path)))
    return files


def _header(text: str) -> dict[str, str]:
    """What a results file's header says: the first line of each kind, as it wrote it."""
    def first(pattern: str) -> str:
        m = re.search(pattern, text, re.M)
        return m.group(1).strip() if m else "not stated"

    machine = first(r"^- machine: (?:vm: )?([^;\n]*)")
    gpu = first(r"^- GPU: ([^,\n]*)")
    return {"title": first(r"^# (.*)"), "machine": machine if gpu == "not stated" else f"{gpu} ({machine})",
            "commit": first(r"\bcommit ([0-9a-f]{7,}(?:\+dirty)?)"), "date": first(r"^- date: (.*)")}


def _table(config) -> str:
    rows = ["| results | what | machine | commit | date |", "|---|---|---|---|---|"]
    for path in sorted(_results(config).glob("*.md")):
        if path.stem.endswith("-quick"):
            continue
        h = _header(path.read_text())
        if "newest first" in h["title"]:
            h["date"] += " (newest entry)"
        rows.append(f"| [{path.stem}](benchmarks/results/{path.name}) | {h['title'].replace('|', '/')} | "
                    f"{h['machine']} | {h['commit']} | {h['date']} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    if uri == "benchmarks.md":
        return markdown.replace(PLACEHOLDER, _table(config))
    if uri.startswith("benchmarks/results/") and uri.endswith(".md"):
        plot = Path(uri).with_suffix(".png").name
        if (_results(config) / plot).exists() and f"]({plot})" not in markdown:
            markdown += f"\n\n![{Path(uri).stem}: plot]({plot})\n"
    return markdown
