"""Two settings of one sweep put through the framework's own test (mhalab.analysis.report.stats.claim_verdict): the
new setting as the claim, the old as its one alternative, paired by seed, equivalence by TOST within the margin.

    python scripts/equivalence.py <sweep dir> new=model.dropout_draw=16bit old=model.dropout_draw=torch [margin=1]
        [metric=val/acc] [out=FILE]

Prints (or writes) the verdict: **no practical difference** (within the margin), **supported** / **contradicted** (the
new one better / worse), or **inconclusive**, with the effect's 95% interval, the TOST p-value, the seeds, and the
seeds per group that would decide at 80% power.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from mhalab.analysis.report import stats
from mhalab.analysis.report.collect import read_sweep
from mhalab.errors import one_line_errors


@one_line_errors
def main(argv: list[str]) -> int:
    if not argv or "=" in argv[0]:
        print(__doc__)
        return 2
    root, opts = Path(argv[0]), {"margin": "1", "metric": stats.DEFAULT_METRIC, "out": None}
    opts.update(w.split("=", 1) for w in argv[1:])
    df, _ = read_sweep(root, opts["metric"])
    df = df[stats.valid_mask(df)]
    groups = {}
    for role in ("new", "old"):
        sub = df[df["setting"] == opts[role]]
        if sub.empty:
            print(f"error: {role}={opts[role]}: no finished member has that setting; the sweep's settings are "
                  f"{sorted(df['setting'].unique())}", file=sys.stderr)
            return 2
        groups[role] = stats.GroupStats.of(opts[role], sub)
    scale, unit = stats.points_scale(opts["metric"])
    margin = stats.margin_units(opts["metric"], float(opts["margin"]))
    sign = 1.0 if stats.higher_is_better(opts["metric"]) else -1.0
    verdict, why, (comp,) = stats.claim_verdict(groups["new"], [groups["old"]], sign, margin)
    new, old = groups["new"], groups["old"]
    lines = [(f"`{opts['new']}` against `{opts['old']}` in `{root}` ({opts['metric']}, margin ±{opts['margin']}{unit}; "
              f"`python scripts/equivalence.py {' '.join(argv)}`)"), "",
             f"- {opts['new']}: {scale * new.mean:.2f} ± {scale * new.std:.2f} over {new.n_seeds} seeds",
             f"- {opts['old']}: {scale * old.mean:.2f} ± {scale * old.std:.2f} over {old.n_seeds} seeds",
             (f"- effect (new − old, {comp.test}, {comp.n} seeds): {scale * comp.effect:+.2f}{unit}, 95% CI "
             f"[{scale * comp.ci_low:+.2f}, {scale * comp.ci_high:+.2f}]; p (difference) {stats.fmt_p(comp.p_diff)}, "
             f"p (equivalence, TOST) {stats.fmt_p(comp.p_equivalent)}"),
             f"- verdict: **{verdict}** ({why})"]
    if math.isfinite(comp.seeds_needed):
        lines.append(f"- seeds per group for 80% power at the margin: {comp.seeds_needed:.0f}")
    text = "\n".join(lines) + "\n"
    if opts["out"]:
        Path(opts["out"]).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
