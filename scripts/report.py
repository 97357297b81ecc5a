"""Sweep report for a Hydra multirun dir: results.csv, report.md, plots, verdicts on the article's claims.

    python scripts/report.py multirun/2025-01-01/12-00-00_1234abcd
    python scripts/report.py <multirun dir> metric=val/loss

The same as `mhalab-report` (mhalab.analysis.report.main). Exit status: 0 on success, 2 (one `error:`
line) when the dir holds no metrics.json or does not exist, or the metric is a test metric.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from mhalab.analysis.report import main
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from mhalab.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
