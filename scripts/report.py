"""Sweep report for a Hydra multirun dir: results.csv, report.md, plots, verdicts on the article's claims.

    python scripts/report.py multirun/2025-01-01/12-00-00_1234abcd
    python scripts/report.py <multirun dir> --metric val/loss

Exit status: 0 on success, 2 when the dir holds no metrics.json (or does not exist) or the metric is a
test metric.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from mhalab.analysis.report import DEFAULT_METRIC, NoMembersError, write_report
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from mhalab.analysis.report import DEFAULT_METRIC, NoMembersError, write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("multirun_dir", type=Path, help="the sweep dir (searched recursively for metrics.json)")
    p.add_argument("--metric", default=DEFAULT_METRIC,
                   help=f"validation metric that ranks settings and decides verdicts (default {DEFAULT_METRIC})")
    args = p.parse_args(argv)

    try:
        res = write_report(args.multirun_dir, metric=args.metric)
    except (NoMembersError, ValueError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2

    print(f"members: {res['n_members']} ({res['n_finished']} finished, {len(res['failed'])} failed or incomplete)")
    best = res["best_setting"]
    if best:
        print(f"best by {res['metric']}: {best['setting']} (mean {best['mean']:.4f} over {best['n']} seed(s))")
    for v in res["verdicts"]:
        print(f"  {v['claim']}: {v['verdict']}")
    print(f"wrote {res['results_csv']}")
    print(f"wrote {res['report_md']}")
    for path in res["plots"].values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
