"""LRA-style table of a long-sequence sweep: accuracy, time per step and peak memory per attention kind
per task, beside the Long Range Arena paper's Table 1.

    python scripts/lra_table.py multirun/lra                          # -> multirun/lra/lra_table.md
    python scripts/lra_table.py multirun/lra --out results/lra/README.md --notes-file notes.md --retime

Also writes lra_results.png next to the markdown. Exit status 2 when the dir holds no metrics.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from mhalab.analysis.lra import write_lra_table
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from mhalab.analysis.lra import write_lra_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="markdown path (default <sweep_dir>/lra_table.md)")
    p.add_argument("--title", default=None)
    p.add_argument("--notes", default="", help="markdown put under the title (how the runs were made)")
    p.add_argument("--notes-file", type=Path, default=None, help="read the notes from a file")
    p.add_argument("--retime", action="store_true",
                   help="also re-time a training step of every kind, interleaved, at each task's length (minutes)")
    p.add_argument("--retime-reps", type=int, default=5)
    args = p.parse_args(argv)
    notes = args.notes_file.read_text() if args.notes_file else args.notes
    try:
        res = write_lra_table(args.sweep_dir, args.out, args.title, notes, retime=args.retime,
                              retime_reps=args.retime_reps)
    except FileNotFoundError as e:
        print(f"lra_table: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(res['rows'])} runs; wrote {res['markdown']} and {res['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
