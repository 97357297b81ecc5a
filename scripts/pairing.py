"""What pairing by seed buys: for every comparison of the committed sweeps' claims, the variance of the per-seed
differences (the paired design the report uses) against the variance an unpaired design would have (the two groups'
seed variances summed), and the seeds each design would need for the same power.

    python scripts/pairing.py [root=results/sweeps] [out=results/sweeps/pairing.md] [ways=results/pairing]

`ways`: sweeps run twice at the same code, with PyTorch's draws and with common random numbers (init_draw=keyed,
mhalab.train.common_random), as <ways>/<data set>/<preset>-torch and <preset>-keyed: their comparisons side by side,
and the seeds each would need to find a 1-point effect with 80% power (stats.seeds_needed).

Members of different cells that share a seed share the data order (data.seed = seed), the initial weights wherever
every shape agrees (the model is built right after seed_everything from the global generator: the cells of a
dropout or heads sweep draw the same weights; where a layer's shape differs, as in dim, ff_ratio and head_dim sweeps,
every draw after it differs too) and, for two dropout rates above 0, nested dropout masks (each draw is
one uniform per element against the rate, so the rates consume the stream in step: tests/test_pairing.py). The
ratio paired / unpaired is the share of seeds the paired design needs for the same interval; the correlation
r = 1 - ratio (equal variances) is how much of a seed's luck the two cells share.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from mhalab.analysis.report import compute_verdicts
from mhalab.analysis.report.collect import RESULTS_CSV, results_from_csv
from mhalab.analysis.report.stats import margin_units, seeds_needed

REGIME = "-"  # folders such as sst2-fifth-epoch: another regime, left out of the summary
SAME_SHAPES = ("dropout", "heads")  # presets whose cells all have the same parameter shapes


def comparisons(csv: Path) -> list[dict]:
    """Every paired comparison of a sweep's covered claims: the variances of its per-seed differences and of an
    unpaired design, in points, and the seeds per group the paired design needs at a 1-point margin."""
    out = []
    # the seed-to-seed spread is measured whether or not the members were trained to the end: without planned_steps
    # the report's rule (mhalab.analysis.report.trained), which withholds a verdict, is not applied
    df = results_from_csv(csv).drop(columns=["planned_steps"], errors="ignore")
    for v in compute_verdicts(df):
        for c in v.comparisons:
            a, b = v.claimed.per_seed * 100, c.alternative.per_seed * 100  # points
            shared = a.index.intersection(b.index)
            if c.test != "paired" or len(shared) < 3:
                continue
            paired = float((a[shared] - b[shared]).var(ddof=1))
            unpaired = float(a[shared].var(ddof=1) + b[shared].var(ddof=1))
            out.append({"claim": v.claim, "comparison": f"{v.claimed.label} vs {c.alternative.label}",
                        "seeds": len(shared), "differences": a[shared] - b[shared], "sd paired": paired ** 0.5, "sd unpaired": unpaired ** 0.5,
                        "ratio": paired / unpaired, "seeds needed": seeds_needed(c, margin_units("best_val_acc"))})
    return out


def rows(root: Path) -> pd.DataFrame:
    out = []
    for csv in sorted(root.glob(f"*/*/{RESULTS_CSV}")):
        out += [{"data set": csv.parent.parent.name, "preset": csv.parent.name, **r} for r in comparisons(csv)]
    return pd.DataFrame(out).drop(columns=["seeds needed", "differences"], errors="ignore")


WAYS = ("torch", "keyed")  # init_draw: PyTorch's draws, common random numbers


BOOTSTRAP = 10_000


def variance_ratio_interval(df: pd.DataFrame, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile bootstrap interval of (paired variance summed over the comparisons, keyed) / (the same,
    torch). Each way's seeds are resampled as a whole (its comparisons share them), the two ways independently
    (they share seed numbers, not draws)."""
    rng = np.random.default_rng(seed)
    sums = {}
    for way in WAYS:
        d = pd.concat([r[f"differences {way}"].rename(i) for i, r in df.iterrows()], axis=1).dropna()  # seeds x comps
        picks = rng.integers(0, len(d), size=(BOOTSTRAP, len(d)))
        sums[way] = np.stack([d.to_numpy()[p].var(axis=0, ddof=1).sum() for p in picks])
    ratio = sums["keyed"] / np.where(sums["torch"] > 0, sums["torch"], np.nan)
    low, high = np.nanpercentile(ratio, [2.5, 97.5])
    return float(low), float(high)


def both_ways(root: Path) -> pd.DataFrame:
    """One row per comparison of the sweeps run both ways (<root>/<data set>/<preset>-<way>/results.csv)."""
    out = []
    for csv in sorted(root.glob(f"*/*-keyed/{RESULTS_CSV}")):
        twin = csv.parent.with_name(csv.parent.name[:-len("keyed")] + "torch") / RESULTS_CSV
        if not twin.is_file():
            continue
        by_way = {way: pd.DataFrame(comparisons(f)).set_index("comparison") for way, f in zip(WAYS, (twin, csv))}
        seen, first = [], len(out)  # a comparison of two claims over the same groups (dim 256 vs 64 is head_dim 64
        # vs 16): once, named both ways
        for comp in by_way["torch"].index.intersection(by_way["keyed"].index):
            same = [by_way[w].loc[comp, "differences"].round(9).to_dict() for w in WAYS]
            if same in seen:
                out[first + seen.index(same)]["comparison"] += f" (= {comp})"
                continue
            seen.append(same)
            t, k = by_way["torch"].loc[comp], by_way["keyed"].loc[comp]
            out.append({"data set": csv.parent.parent.name, "preset": csv.parent.name[:-len("-keyed")],
                        "comparison": comp, "seeds": f"{t['seeds']} / {k['seeds']}",
                        **{f"{col} {way}": r[col] for way, r in (("torch", t), ("keyed", k))
                           for col in ("sd paired", "sd unpaired", "ratio", "seeds needed", "differences")}})
    return pd.DataFrame(out)


def ways_markdown(df: pd.DataFrame, root: Path) -> str:
    var = {w: float((df[f"sd paired {w}"] ** 2).sum()) for w in WAYS}
    low, high = variance_ratio_interval(df)
    per_preset = []
    for (data_set, preset), g in df.groupby(["data set", "preset"], sort=False):
        lo, hi = variance_ratio_interval(g)
        ratio = float((g["sd paired keyed"] ** 2).sum() / (g["sd paired torch"] ** 2).sum())
        per_preset.append(f"{data_set} {preset} {ratio:.2f} [{lo:.2f}, {hi:.2f}]")
    lines = [
        "", "## Common random numbers against PyTorch's draws", "",
        (f"Each sweep run twice at the same code and seeds (0-4), once with PyTorch's draws (`init_draw=torch`) and "
         f"once with common random numbers (`init_draw=keyed`): `{root}/<data set>/<preset>-<way>`. Not pooled "
         f"with the sweeps above, nor with each other. Seeds needed: per group, to find a true 1-point effect with "
         f"80% power by the paired test (`stats.seeds_needed`, from that way's own variance; each rests on 5 seeds)."),
        "",
        (f"- Paired variance summed over the {len(df)} comparisons: {var['keyed']:.2f} keyed against "
         f"{var['torch']:.2f} torch (points^2), a ratio of {var['keyed'] / var['torch']:.2f} (95% bootstrap interval "
         f"over seeds [{low:.2f}, {high:.2f}]; by sweep: {'; '.join(per_preset)})."),
        (f"- Ratio paired / unpaired, median: {df['ratio keyed'].median():.2f} keyed, {df['ratio torch'].median():.2f} "
         f"torch; lower with keyed draws in {int((df['ratio keyed'] < df['ratio torch']).sum())} of {len(df)}."),
        (f"- Seeds needed, summed over the comparisons: {df['seeds needed keyed'].sum():.0f} keyed, "
         f"{df['seeds needed torch'].sum():.0f} torch."), "",
        "| data set | preset | comparison | sd paired, torch | keyed | ratio, torch | keyed | seeds needed, torch | keyed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in df.to_dict("records"):
        lines.append(f"| {r['data set']} | {r['preset']} | {r['comparison']} | {r['sd paired torch']:.2f} | "
                     f"{r['sd paired keyed']:.2f} | {r['ratio torch']:.2f} | {r['ratio keyed']:.2f} | "
                     f"{r['seeds needed torch']:.0f} | {r['seeds needed keyed']:.0f} |")
    return "\n".join(lines) + "\n"


def markdown(df: pd.DataFrame) -> str:
    main = df[~df["data set"].str.contains(REGIME)]
    q = main["ratio"].quantile([0.25, 0.5, 0.75])
    same = main[main["preset"].isin(SAME_SHAPES)]
    other = main[~main["preset"].isin(SAME_SHAPES)]
    drop = main[(main["preset"] == "dropout")]
    drop_pos = drop[~drop["comparison"].str.endswith("dropout=0")]
    lines = [
        "# Pairing by seed: the paired differences' variance against the unpaired", "",
        ("Written by `python scripts/pairing.py` from the committed sweeps' results.csv (every comparison of a "
         "covered claim with a paired test over at least 3 shared seeds). Points of validation accuracy; ratio = "
         "variance of the per-seed differences / (the two groups' seed variances summed): the share of seeds the "
         "paired design needs for the same interval width."), "",
        (f"- Default-scale sweeps: {len(main)} comparisons; ratio median {q[0.5]:.2f} (quartiles {q[0.25]:.2f}-"
         f"{q[0.75]:.2f}); pairing lowers the variance in {int((main['ratio'] < 1).sum())} of {len(main)}."),
        (f"- Presets whose cells have the same parameter shapes (dropout, heads: the same initial weights): median "
         f"ratio {same['ratio'].median():.2f} over {len(same)}; presets that change shapes (dim, ff_ratio, "
         f"head_dim: the draws part after the first differing layer): {other['ratio'].median():.2f} over "
         f"{len(other)}."),
        (f"- Dropout: 0.1 against 0.2 / 0.3 (nested masks as well): median {drop_pos['ratio'].median():.2f} over "
         f"{len(drop_pos)}; against 0 (no dropout stream to share): median "
         f"{drop[drop['comparison'].str.endswith('dropout=0')]['ratio'].median():.2f} over "
         f"{int(drop['comparison'].str.endswith('dropout=0').sum())}."), "",
        "| data set | preset | comparison | seeds | sd of differences, paired | unpaired | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in df.itertuples(index=False):
        lines.append(f"| {r[0]} | {r[1]} | {r[3]} | {r[4]} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    opts = dict(a.split("=", 1) for a in argv)
    root, out = Path(opts.get("root", "results/sweeps")), Path(opts.get("out", "results/sweeps/pairing.md"))
    df = rows(root)
    if df.empty:
        print(f"error: no paired comparison in {root}/*/*/{RESULTS_CSV}", file=sys.stderr)
        return 2
    text = markdown(df)
    if "ways" in opts:
        ways = both_ways(Path(opts["ways"]))
        if ways.empty:
            print(f"error: no <data set>/<preset>-keyed sweep with its -torch twin in {opts['ways']}", file=sys.stderr)
            return 2
        text += ways_markdown(ways, Path(opts["ways"]))
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return 0 if np.isfinite(df["ratio"]).all() else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
