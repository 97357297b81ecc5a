"""Seeds until decided: Hydra's basic sweeper, which with ``sweep.until_decided=true`` adds seeds in rounds to the
groups of the claims still inconclusive and stops when each claim is decided or ``sweep.max_seeds`` is reached::

    mhalab-train sweep=dropout data=sst2 sweep.until_decided=true sweep.max_seeds=20

The sweep's own seeds (``seed: 0,1,2,3,4`` in the preset) are the first look. After each round the sweep is read
by mhalab.analysis.report.sequential (repeated confidence intervals with O'Brien-Fleming-type alpha spending,
calibrated to about alpha over the planned looks); the next round runs ``sweep.round_seeds`` new seeds of the
settings in the groups of undecided comparisons only (the claimed group and the alternatives not yet decided).
The design (first seeds, round_seeds, max_seeds, alpha, margin) is fixed at the first look: ``<sweep
dir>/sequential.json`` records it with each look's seeds and outcome and why the sweep stopped, a re-run with
another design is refused in one line, and only ``sweep.extend_to=N`` extends it (spending the alpha not yet
spent). A member already finished is never run again, and the finished rows of a results.csv in the sweep dir whose
member dirs are gone count as members (copy a committed results.csv into the dir to continue its sweep). The rounds
are a function of the results, so a stopped sweep re-run with the same command replays its looks and goes on
where it stopped; its last log line says why it stopped.

The sweep presets select this sweeper (conf/sweep/cpu_scale.yaml and gpu_scale.yaml); a plain ``-m`` sweep names
it (``-m hydra/sweeper=until_decided``). With ``sweep.until_decided=false`` (the default) it is Hydra's
BasicSweeper, unchanged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from mhalab.errors import ConfigError, UserError, exit_with

log = logging.getLogger(__name__)


def _key(overrides: list[str], seed: Any) -> tuple[frozenset, float]:
    from mhalab.analysis.report.collect import run_key, setting_of

    return run_key(setting_of(overrides), seed)


def _check_draws(df, init_draw: str, root: Path) -> None:
    """Refuse to continue a sweep whose finished rows drew their initial weights another way than this run would."""
    other = sorted(set(df["init_draw"].dropna()) - {init_draw})
    if other:
        raise ConfigError(f"{root} holds members with init_draw={', '.join(other)} and this sweep would add members "
                          f"with init_draw={init_draw}: they would not be replicates. Continue it with "
                          f"init_draw={other[0]}, or give a new hydra.sweep.dir.")


class UntilDecidedSweeper(BasicSweeper):
    """BasicSweeper, plus rounds of seeds until the sweep's claims are decided (the module docstring)."""

    def sweep(self, arguments: list[str]) -> Any:
        opts = self.config.get("sweep") or {}
        if not opts.get("until_decided", False):
            return super().sweep(arguments)
        from mhalab.analysis.report import DEFAULT_METRIC
        from mhalab.analysis.report import sequential as seq
        from mhalab.analysis.report.collect import NoMembersError, read_sweep

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        jobs = self.split_arguments(parser.parse_overrides([*self._parse_config(), *arguments]), None)[0]
        seeds = sorted({int(o.split("=", 1)[1]) for job in jobs for o in job if o.startswith("seed=")})
        max_seeds, round_seeds, alpha = int(opts.max_seeds), int(opts.round_seeds), float(opts.alpha)
        margin = None if opts.get("margin") is None else float(opts.margin)
        extend_to = None if opts.get("extend_to") is None else int(opts.extend_to)
        if not seeds:  # one line and exit 2 before any member runs, as mhalab.errors does for every user error
            exit_with(ConfigError("sweep.until_decided=true adds seeds to a sweep over seeds: give the first ones "
                              "(hydra.sweeper.params.seed=0,1,2,3,4, as the sweep presets do)"))
        if not (len(seeds) >= 2 and round_seeds >= 1 and max_seeds > len(seeds) and 0 < alpha < 1):
            exit_with(ConfigError(f"sweep.max_seeds={max_seeds}, sweep.round_seeds={round_seeds}, "
                                  f"sweep.alpha={alpha} with {len(seeds)} first seeds: needs at least 2 first seeds "
                                  "(seed=0,1,...), max_seeds above their number, round_seeds >= 1 and alpha in (0, 1)"))
        if margin is not None and not margin > 0:
            exit_with(ConfigError(f"sweep.margin={margin} must be > 0: the smallest difference that matters, in "
                                  "points of accuracy (null: 1)"))
        root = Path(str(self.config.hydra.sweep.dir))
        design = seq.new_design(len(seeds), round_seeds, max_seeds, alpha, margin, DEFAULT_METRIC)
        try:  # the design is fixed at the first look: a re-run reads it, and only sweep.extend_to changes it
            if record := seq.read_record(root):
                if record["looks"] and record["looks"][0] != seeds:
                    raise ConfigError(f"seed={','.join(map(str, seeds))}: this sweep's first look ran seeds "
                                      f"{','.join(map(str, record['looks'][0]))} ({seq.RECORD}); give those")
                seq.check_design(record["design"], design, extend_to)
                design = record["design"]
                if extend_to is not None and extend_to > seq.max_at(design, len(record["looks"])):
                    design = seq.extend(design, record["looks"], extend_to)
            elif extend_to is not None:
                raise ConfigError(f"sweep.extend_to={extend_to} extends a sweep already run until decided, and "
                                  f"{root} has no {seq.RECORD}: for a new sweep give sweep.max_seeds={extend_to}")
        except ConfigError as e:
            exit_with(e)
        templates = {}  # a setting's key -> its job's overrides, seed last
        for job in jobs:
            rest = [o for o in job if not o.startswith("seed=")]
            templates.setdefault(_key(rest, 0)[0], rest)
        root.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, root / "multirun.yaml")
        command = self._command(root)

        active, looks, returns, job_idx = set(templates), [], [], 0
        while True:
            try:
                df = read_sweep(root)[0]
                done = {_key(str(o).split(" "), s) for o, s, st in zip(df["overrides"], df["seed"], df["status"])
                        if st == "finished"}
                if not looks:  # before any member runs: rows drawn another way are no replicates of this sweep's
                    _check_draws(df, str(self.config.get("init_draw", "torch")), root)
            except NoMembersError:  # a new sweep
                done = set()
            except UserError as e:  # rows that cannot be averaged (integrity), or drawn another way: one line
                exit_with(e)
            batch = [[*templates[k], f"seed={s}"] for k in templates if k in active for s in seeds
                     if (k, float(s)) not in done]
            if batch:
                self.validate_batch_is_legal(batch)
                results = self.launcher.launch(batch, initial_job_idx=job_idx)
                for r in results:
                    _ = r.return_value  # a failed member fails the sweep, as in BasicSweeper
                job_idx += len(batch)
                returns.append(results)
            looks.append(list(seeds))
            try:
                df = read_sweep(root)[0]
            except UserError as e:
                exit_with(e)
            read = seq.read_looks(df, looks, design)
            last, stop = read[-1], seq.stop_reason(read, design, df)
            (root / seq.RECORD).write_text(json.dumps(
                {"design": design, "command": command,
                 "looks": [{"seeds": x["seeds"], "verdicts": {k: c["verdict"] for k, c in x["claims"].items()}}
                           for x in read],
                 "stopped": stop}, indent=2))
            log.info("look %d (%d seeds): %s", len(looks), len(seeds),
                     "; ".join(f"{c['claim']}: {c['verdict']}" for c in last["claims"].values()) or "no claim")
            if stop:
                log.info("stopped: %s", seq.stop_words(stop, read, design, command))
                return returns
            rows = df.loc[last["undecided_rows"]]
            active = {_key(str(o).split(" "), 0)[0] for o in rows["overrides"]} & set(templates)
            room = seq.max_at(design, len(looks)) - len(seeds)  # under the max_seeds in force at the next look
            seeds = seeds + list(range(max(seeds) + 1, max(seeds) + 1 + min(round_seeds, room)))

    def _command(self, root: Path) -> str:
        """The command that runs this sweep again (and so continues it): the overrides as typed, into its dir."""
        given = [str(o) for o in self.config.hydra.overrides.hydra  # -m stands for hydra.mode=MULTIRUN
                 if not str(o).startswith(("hydra.sweep.dir=", "hydra.mode="))]
        return " ".join(["mhalab-train -m", *given, *map(str, self.config.hydra.overrides.task),
                         f"hydra.sweep.dir={root}"])
