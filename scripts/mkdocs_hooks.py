"""mkdocs hooks: publish the committed example report (reports/smollm2-135m-w4a8/) under example/ as it is.

The report, its model card and their artifacts are the files `evalsuite demo --out reports/smollm2-135m-w4a8
...` wrote (docs/getting-started.md gives the whole command); the site shows them unchanged, so that the page
a user reads is the report a run writes.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

EXAMPLE = Path(__file__).resolve().parent.parent / "reports" / "smollm2-135m-w4a8"
PUBLISHED = ("report.md", "model-card.md", "artifacts/*")


def on_files(files: Files, config) -> Files:
    """Add the example report's pages and pictures to the site, under example/."""
    for pattern in PUBLISHED:
        for path in sorted(EXAMPLE.glob(pattern)):
            relative = path.relative_to(EXAMPLE).as_posix()
            files.append(File.generated(config, f"example/{relative}", abs_src_path=str(path)))
    return files
