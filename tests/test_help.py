"""Each Hydra command's --help opens with what it does and its most useful options (hydra.help.header in its config),
then the config groups: not Hydra's "<app> is powered by Hydra." first."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

COMMANDS = {"mhalab-train": "train", "mhalab-eval": "eval", "mhalab-predict": "predict",
            "mhalab-ensemble": "ensemble", "mhalab-baseline": "baseline"}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_opens_with_what_the_command_does_and_its_options_then_the_groups(command, fork_server, tmp_path):
    proc = fork_server.run([str(Path(sys.executable).parent / command), "--help"], cwd=tmp_path,
                           env=dict(os.environ, PYTHONHASHSEED="0"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    paragraph, rest = proc.stdout.split("\n\n", 1)
    assert paragraph.startswith(f"{command}: ") and "Most useful: " in paragraph, paragraph
    assert len(paragraph.splitlines()) <= 8  # one paragraph, not a page
    assert rest.startswith("== Configuration groups ==\n"), rest[:200]
    assert "powered by Hydra" not in proc.stdout and "--hydra-help" in proc.stdout
    assert not list(tmp_path.iterdir())  # --help writes nothing
