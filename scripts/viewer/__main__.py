"""`python -m scripts.viewer DUMP_DIR [...] -o trajectories.html`: one self-contained HTML page of a
run's trajectory dumps (see scripts/viewer/__init__.py and docs/viewer.md)."""

from __future__ import annotations

import argparse
import sys

from scripts.viewer import DumpError, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.viewer", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="dump folders (<step>.jsonl files), folders of them, or JSONL files")
    parser.add_argument("-o", "--output", default="trajectories.html", help="the page to write")
    parser.add_argument("--title", default="Search-R1 trajectories")
    parser.add_argument("--no-compress", action="store_true",
                        help="embed the data as plain JSON (for a browser without DecompressionStream); ~5x larger")
    args = parser.parse_args(argv)
    try:
        out = build(args.paths, args.output, args.title, compress=not args.no_compress)
    except DumpError as err:
        print(f"viewer: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB); open it in a browser (file://{out.resolve()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
