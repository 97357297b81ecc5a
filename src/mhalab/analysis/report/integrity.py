"""A sweep's rows checked before anything is averaged: the one place where a results table is refused or normalised.

A mean over seeds is only as good as the rows under it, and each corruption below changes a verdict without an
error if nothing looks (an audit of the SST-2 dropout sweep: a duplicated row 2 points lower turns "equivalent"
into "unclear"; seeds as text in one group turn the paired test into Welch's; an accuracy in percent makes the
1-point margin 0.01). ``check_rows`` is called by collect.read_sweep, so mhalab-report, mhalab-claims and the
until_decided sweeper read the same checked table:

* a (setting, seed) present in two finished rows: counted once when the rows agree (stated in the report), refused
  when their values differ (which one is right is the user's call);
* seeds of mixed types (``3`` and ``"3"``): text that is an integer is read as one (stated), any other seed refused;
* an accuracy outside [0, 1] (a percentage): refused;
* a member whose config differs from its setting's other members in a key that is not swept (a seed run at other
  epochs is not a replicate): refused.

A refusal is a DataError, one line that names the rows (results.csv's line, or the member's dir) and the fix.
"""

from __future__ import annotations

import pandas as pd

from mhalab.analysis.report.stats import points_scale, valid_mask
from mhalab.analysis.report.values import fmt_num, run_key, to_float
from mhalab.errors import DataError

ACCURACIES = ("best_val_acc", "final_val_acc", "test_acc")  # fractions in [0, 1], whatever the monitored metric
# the config of a run: one value per setting (the swept keys are in the setting, so any difference is not swept)
CONFIG = ("dim", "heads", "head_dim", "layers", "ff_dim", "dropout", "lr", "batch_size", "max_epochs", "max_len",
          "dataset", "attention", "pos", "init_draw", "dropout_draw")
SHOWN = 4  # rows named in a message, then "and N more"


class SweepDataError(DataError):
    """A results table whose rows cannot be averaged as they are."""


def _names(df: pd.DataFrame, index: list) -> str:
    """Rows as a user finds them: their lines in results.csv (``_line``; the header is line 1), else their member
    dirs; the first SHOWN of them."""
    lines = df.loc[index, "_line"] if "_line" in df else pd.Series(None, index=index)
    csv = [str(int(x)) for x in lines if pd.notna(x)]
    dirs = [str(m) for m, x in zip(df.loc[index, "member"], lines) if pd.isna(x)]
    parts = ([f"results.csv line{'s' * (len(csv) > 1)} {', '.join(csv[:SHOWN])}"] if csv else []) + (
        [f"member{'s' * (len(dirs) > 1)} {', '.join(dirs[:SHOWN])}"] if dirs else [])
    more = max(len(csv) - SHOWN, 0) + max(len(dirs) - SHOWN, 0)
    return " and ".join(parts) + (f" (and {more} more)" if more else "")


def _value(v) -> str:
    return fmt_num(v) if isinstance(v, float) else str(v)


def _seeds(df: pd.DataFrame, notes: list[str]) -> pd.DataFrame:
    """Seeds as integers: integral text or floats are read as ints (said when any was text), anything else refused."""
    seeds = df["seed"]
    numbers = seeds.map(to_float)
    text = seeds.map(lambda s: isinstance(s, str))
    bad = seeds.notna() & ~(numbers.notna() & (numbers % 1 == 0))
    if bad.any():
        raise SweepDataError(f"seed {seeds[bad].iloc[0]!r} at {_names(df, list(df.index[bad]))} is not an integer: a "
                             "seed is the integer a run was started with (seed=3); correct or remove those rows")
    if text.any() and (~text & seeds.notna()).any():
        notes.append(f"{int(text.sum())} rows held their seed as text (`'{seeds[text].iloc[0]}'`) and the others as "
                     "numbers; all are read as numbers, so the same seed pairs across groups")
    df = df.copy()
    df["seed"] = numbers.map(lambda x: int(x) if pd.notna(x) else None).astype(object)
    return df


def _accuracies(df: pd.DataFrame, metric: str) -> None:
    cols = [c for c in ACCURACIES if c in df] + (["monitored"] if points_scale(metric)[0] == 100 else [])
    for c in cols:
        v = pd.to_numeric(df[c], errors="coerce")
        out = v.notna() & ((v < 0) | (v > 1))
        if out.any():
            x = float(v[out].iloc[0])
            raise SweepDataError(f"{c} {x:g} at {_names(df, list(df.index[out]))} is outside [0, 1]: an accuracy is a "
                                 f"fraction ({x:g}% is {x / 100:g}); divide the column by 100")


def _duplicates(df: pd.DataFrame, metric: str, notes: list[str]) -> pd.DataFrame:
    """Finished rows of one (setting, seed): identical ones counted once, differing ones refused."""
    ok = df[valid_mask(df)]
    keys = pd.Series([str(sorted(words)) + f" seed={seed}" for words, seed in map(run_key, ok["setting"], ok["seed"])],
                     index=ok.index)  # whatever the order the overrides were typed in
    dup = keys.duplicated(keep=False)
    if not dup.any():
        return df
    dropped = []
    for _, group in ok[dup].groupby(keys[dup], sort=False):
        values = pd.to_numeric(group["monitored"], errors="coerce")
        if values.nunique() > 1:
            raise SweepDataError(
                f"setting '{group['setting'].iloc[0]}' seed {group['seed'].iloc[0]} is in {len(group)} finished rows "
                f"with different {metric} ({', '.join(f'{v:g}' for v in values)}; {_names(df, list(group.index))}): "
                "a seed is one sample; keep the row of the run you trust and remove the other")
        dropped += list(group.index[1:])
    many = len(dropped) > 1
    notes.append(f"{len(dropped)} row{'s' * many} repeated another row's setting, seed and {metric} exactly "
                 f"({_names(df, dropped)}); {'each' if many else 'it'} is counted once")
    out = df.drop(index=dropped)
    out.attrs = dict(df.attrs)
    return out


def _configs(df: pd.DataFrame) -> None:
    ok = df[valid_mask(df)]
    for setting, group in ok.groupby("setting", sort=False):
        for c in (c for c in CONFIG if c in group):
            values = group[c].dropna()  # a row written before a column existed leaves it empty: not compared
            values = values.map(lambda v: to_float(v) if pd.notna(to_float(v)) else str(v))
            counts = values.value_counts()
            if len(counts) < 2:
                continue
            usual = counts.index[0]
            odd = list(values.index[values != usual])
            raise SweepDataError(
                f"setting '{setting}': {_names(df, odd)} ran with {c}={_value(values[odd[0]])} where its other seeds "
                f"ran with {c}={_value(usual)}; {c} is not swept, so those runs are not replicates of the setting: remove them, or "
                f"sweep {c}")


def check_rows(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """df checked (SweepDataError for what cannot be averaged) and normalised; what was normalised is listed in
    ``df.attrs["notes"]`` for the report to say."""
    notes: list[str] = list(df.attrs.get("notes", []))
    attrs = dict(df.attrs)
    df = _seeds(df, notes)
    df.attrs = attrs
    _accuracies(df, metric)
    df = _duplicates(df, metric, notes)
    _configs(df)
    df.attrs["notes"] = notes
    return df
