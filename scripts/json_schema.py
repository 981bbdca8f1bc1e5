"""Write docs/schema/*.schema.json, the JSON Schema of every document evalsuite writes, from the typed models
in `evalsuite.contract.results`, so that the published schema cannot drift from the code.

    python scripts/json_schema.py [--out docs/schema] [--check]

`--check` writes nothing and exits 1 when a file differs from what the models generate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDER = REPO / "docs" / "schema"


def render() -> dict[str, str]:
    """Each schema file's name and text, as the models generate them."""
    from evalsuite.contract.results import SCHEMAS, json_schema

    return {f"{kind}.schema.json": json.dumps(json_schema(kind), indent=2) + "\n" for kind in SCHEMAS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FOLDER)
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is not what the models say")
    args = parser.parse_args(argv)
    pages = render()
    if args.check:
        stale = [
            n for n, t in pages.items() if not (args.out / n).is_file() or (args.out / n).read_text() != t
        ]
        if stale:
            print(f"{', '.join(stale)} in {args.out} differ from the models: run scripts/json_schema.py")
            return 1
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (args.out / name).write_text(text, encoding="utf-8")
        print(f"written: {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
