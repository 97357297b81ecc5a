"""tests/fork_server.py starts a command as a fresh interpreter would: the same argv, working directory, environment,
sys.path, stdin, output and exit status (an exception's traceback, SystemExit's code, death by a signal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

PROBE = '''
import json, os, signal, sys
what = sys.argv[1]
# Ctrl-C as at a terminal: a process started by a pytest-xdist worker inherits SIGINT ignored (fresh or forked)
signal.signal(signal.SIGINT, signal.default_int_handler)
if what == "show":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "extra": sys.path[1],
                      "name": __name__, "env": os.environ.get("PROBE_VALUE"), "stdin": sys.stdin.read()}))
elif what == "exit":
    print("bye", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
elif what == "message":
    sys.exit("a message")
elif what == "raise":
    raise ValueError("boom")
elif what == "wait":
    print("waiting", flush=True)
    import time
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    (d / "scripts").mkdir()
    (d / "scripts" / "probe.py").write_text(PROBE)
    return d


def _both(fork_server, probe, *args, **kw) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    argv = [sys.executable, "scripts/probe.py", *args]
    env = dict(os.environ, PYTHONHASHSEED="0", PROBE_VALUE="x y", PYTHONPATH=str(probe / "lib"))
    real = subprocess.run(argv, cwd=probe, env=env, capture_output=True, text=True, timeout=60, check=False, **kw)
    forked = fork_server.run(argv, cwd=probe, env=env, timeout=60, **kw)
    return real, forked


def test_a_forked_command_sees_what_a_fresh_interpreter_sees(fork_server, probe):
    real, forked = _both(fork_server, probe, "show", input="typed\n")
    assert real.returncode == forked.returncode == 0, forked.stderr
    assert json.loads(forked.stdout) == json.loads(real.stdout) == {
        "argv": ["scripts/probe.py", "show"], "cwd": str(probe), "path0": str(probe / "scripts"),
        "extra": str(probe / "lib"), "name": "__main__", "env": "x y", "stdin": "typed\n"}


@pytest.mark.parametrize("args, code", [(["exit", "3"], 3), (["exit", "0"], 0), (["message"], 1), (["raise"], 1)])
def test_a_forked_command_ends_with_the_exit_status_and_stderr_of_a_fresh_one(fork_server, probe, args, code):
    real, forked = _both(fork_server, probe, *args)
    assert real.returncode == forked.returncode == code
    last = real.stderr.strip().splitlines()[-1]
    assert forked.stderr.strip().splitlines()[-1] == last  # "bye", "a message", "ValueError: boom"
    assert ("Traceback" in forked.stderr) == ("Traceback" in real.stderr) == (args == ["raise"])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_reaches_the_forked_command_and_ends_it_as_a_fresh_one(fork_server, probe, sig):
    env = dict(os.environ, PYTHONHASHSEED="0")
    argv = [sys.executable, "scripts/probe.py", "wait"]
    real = subprocess.Popen(argv, cwd=probe, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    forked = fork_server.popen(argv, cwd=probe, env=env)
    assert real.stdout.readline() == "waiting\n"
    deadline = time.time() + 30
    while "waiting" not in (forked.files / "stdout").read_text() and time.time() < deadline:
        time.sleep(0.02)
    for p in (real, forked):
        p.send_signal(sig)
    real.communicate(timeout=30)
    _, err = forked.communicate(timeout=30)
    assert forked.returncode == real.returncode == -sig  # Ctrl-C: KeyboardInterrupt, then death by SIGINT
    assert ("KeyboardInterrupt" in err) == (sig == signal.SIGINT)


def test_a_command_that_needs_another_start_is_refused(fork_server, probe):
    for env in (dict(os.environ, PYTHONHASHSEED="1"), dict(os.environ, PYTHONHASHSEED="0", MHALAB_ALLOCATOR="system")):
        with pytest.raises(ValueError, match="run this command with subprocess"):
            fork_server.popen([sys.executable, "scripts/probe.py", "show"], cwd=probe, env=env)
    with pytest.raises(ValueError, match="-c"):
        fork_server.popen([sys.executable, "-c", "pass"], cwd=probe)
