"""Write the README's tour block from the real console output of `evalsuite demo`.

Runs `evalsuite demo --quiet` from the repository root (its reports go to the git-ignored demo-reports/),
or reads a saved copy of that output (`--from FILE`), and writes it between the README's markers
`<!-- tour:start -->` and `<!-- tour:end -->`, as a console block. Progress lines and the fixture
builder's timings are left out: the README quotes no figure that goes stale with the machine (figures are
the benches', docs/benchmarks.md).

    flock /tmp/evalsuite-heavy.lock python scripts/readme_tour.py [--from FILE] [--readme README.md]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
START, END = "<!-- tour:start -->", "<!-- tour:end -->"
COMMAND = "evalsuite demo"
# Lines that say how long something took on this machine, or draw progress: not part of the tour.
DROPPED = (
    re.compile(r": built in [\d.]+ s$"),
    re.compile(r": building$"),
    re.compile(r"\d+/\d+ \[[\d:]+<"),
    re.compile(r"━"),
    re.compile(r"^\s*$"),
)


def demo_output() -> str:
    """stderr and stdout of `evalsuite demo --quiet`, run from the repository root, in that order."""
    proc = subprocess.run(
        [sys.executable, "-m", "evalsuite.cli", "demo", "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode not in (0, 1):
        raise SystemExit(f"evalsuite demo exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stderr + proc.stdout


def tour_block(output: str) -> str:
    """The console block: the command and its output, without progress and timing lines."""
    kept = [line.rstrip() for line in output.splitlines() if not any(p.search(line) for p in DROPPED)]
    kept = [line.replace(str(Path.home()), "~") for line in kept]
    return "\n".join([START, "```console", f"$ {COMMAND}", *kept, "```", END])


def with_tour(readme: str, block: str) -> str:
    """`readme` with its tour block replaced by `block`."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"the README has no {START} … {END} block")
    return readme[:start] + block + readme[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="saved", type=Path, help="a saved output of `evalsuite demo --quiet`")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    output = args.saved.read_text(encoding="utf-8") if args.saved else demo_output()
    args.readme.write_text(with_tour(args.readme.read_text(encoding="utf-8"), tour_block(output)), "utf-8")
    print(f"written: {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
