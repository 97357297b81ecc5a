"""Run several command lines of the project's scripts in ONE Python process, as `python <script> <args>` would.

tests/test_cli_errors.py has ~30 mistakes to check, and every fresh interpreter pays ~4 s of imports
(torch, Lightning) before the config is even read. This runs each command's script with runpy as
`__main__`, with its argv, and reports per command what a shell would see: the exit status, stdout and
stderr (an exception that escapes the script is printed as Python would print it: a Traceback).
Usage: python tests/cli_driver.py <commands.json> <results.json>, commands = [[script, arg, ...], ...]; a
script named like a console command of pyproject.toml's [project.scripts] (mhalab-eval) calls its entry
function, as the installed command does.
"""

import contextlib
import importlib
import io
import json
import re
import runpy
import sys
import traceback
from pathlib import Path


def console_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts] table, {command: "module:function"} (no tomllib on Python 3.10)."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    table = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', table, re.MULTILINE))


SCRIPTS = console_scripts()


def run_script(path: str) -> None:
    if path in SCRIPTS:  # "module:function", what pip's console-script wrapper calls
        module, function = SCRIPTS[path].split(":")
        getattr(importlib.import_module(module), function)()
    else:
        runpy.run_path(path, run_name="__main__")


def run_one(argv: list[str]) -> dict:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = list(argv)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_script(argv[0])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 (what the interpreter prints for an uncaught exception)
            traceback.print_exc()
            code = 1
    return {"args": argv, "returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    commands_path, results_path = sys.argv[1:3]  # run_one() replaces sys.argv
    with open(commands_path) as f:
        commands = json.load(f)
    results = [run_one(c) for c in commands]
    with open(results_path, "w") as f:
        json.dump(results, f)
