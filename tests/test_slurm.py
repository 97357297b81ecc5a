"""A sweep submitted to SLURM through Hydra's submitit launcher (`hydra/launcher=slurm`), on a SLURM of four small
commands (there is no cluster here): `sbatch` keeps the job script it is given, answers with a job id and then runs
each array task, in the environment SLURM gives a task; `srun` runs the task's command; `sacct` reports the tasks'
states.

So the test sees what a cluster would be sent (the #SBATCH lines, the srun line, the signal that warns of the end)
and that the runs it starts finish in their sweep's member dirs, with the job's id in their records; what it
cannot see is a real scheduler (queueing, pre-emption, requeue).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from mhalab.train import record

# sbatch: answer with a job id at once (submitit writes the tasks' pickles after that), then run every array task,
# one after another, in the environment SLURM gives a task; keep the script and each task's environment
SBATCH = r'''
import json, os, re, subprocess, sys
from pathlib import Path
log = Path(os.environ["FAKE_SLURM_LOG"]); log.mkdir(exist_ok=True)
script = Path(sys.argv[-1]).read_text()
opts = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, re.M))
job = 4242 + len(list(log.glob("job_*.sh")))
(log / f"job_{job}.sh").write_text(script)
lo, hi = map(int, re.match(r"(\d+)-(\d+)", opts.get("array", "0-0")).groups())

def set_state(task, state):
    path = log / "states.json"
    states = json.loads(path.read_text()) if path.exists() else {}
    states[f"{job}_{task}"] = state
    (log / "states.tmp").write_text(json.dumps(states))
    os.replace(log / "states.tmp", path)

for i in range(lo, hi + 1):
    set_state(i, "PENDING")
if os.fork() == 0:  # the scheduler: after sbatch has answered, with sbatch's output closed
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for i in range(lo, hi + 1):
        env = dict(os.environ, SLURM_JOB_ID=str(job * 100 + i), SLURM_ARRAY_JOB_ID=str(job), SLURM_ARRAY_TASK_ID=str(i),
                   SLURM_JOB_NAME=opts.get("job-name", "job"), SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0",
                   SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="1",
                   SLURM_JOB_NODELIST="localhost", SLURM_CPUS_PER_TASK=opts.get("cpus-per-task", "1"))
        (log / f"env_{job}_{i}.json").write_text(json.dumps({k: v for k, v in env.items() if k.startswith("SLURM")}))
        out = opts["output"].replace("%A", str(job)).replace("%a", str(i))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        set_state(i, "RUNNING")
        with open(out, "a") as f:
            code = subprocess.run(["bash", "-c", script], env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        set_state(i, "COMPLETED" if code == 0 else "FAILED")
    os._exit(0)
print(f"Submitted batch job {job}")
'''
# srun: the task's command, its output where --output / --error say (%A array job, %a task, %t task rank)
SRUN = r'''
import os, subprocess, sys
args, files = sys.argv[1:], {}
while args and args[0].startswith("--"):
    flag = args.pop(0)
    if flag in ("--output", "--error"):
        files[flag] = args.pop(0).replace("%A", os.environ["SLURM_ARRAY_JOB_ID"]).replace(
            "%a", os.environ["SLURM_ARRAY_TASK_ID"]).replace("%t", "0")
with open(files["--output"], "a") as out, open(files["--error"], "a") as err:
    sys.exit(subprocess.run(args, stdout=out, stderr=err).returncode)
'''
SACCT = r'''
import json, os
from pathlib import Path
path = Path(os.environ["FAKE_SLURM_LOG"]) / "states.json"
states = json.loads(path.read_text()) if path.exists() else {}
print("JobID|State|NodeList")
for job, state in states.items():
    print(f"{job}|{state}|localhost")
'''


def _fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, body in (("sbatch", SBATCH), ("srun", SRUN), ("sacct", SACCT), ("scancel", "")):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.slow  # ~20 s: a submitit sweep of local array tasks (make test-slow); its command is composed in CI
def test_sweep_through_submitit_submits_one_array_job_whose_tasks_train_each_member(tmp_path, toy_data_dir):
    _fake_slurm(tmp_path / "bin")
    log, sweep = tmp_path / "slurm", tmp_path / "sweep"
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(log),
               PYTHONHASHSEED="0")
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
           f"hydra.sweep.dir={sweep}", "seed=0,1", f"paths.data_dir={toy_data_dir}",
           f"paths.cache_dir={tmp_path / 'cache'}", "trainer=cpu", "trainer.enable_progress_bar=false",
           "callbacks.progress_bar=null", "dim=32", "heads=4", "layers=1", "batch_size=16", "max_len=32",
           "data.vocab_size=200", "data.min_frequency=1", "max_epochs=1", "++trainer.limit_train_batches=3",
           "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # what the cluster is sent: one array job of two tasks, with slurm.yaml's resources and the end-of-time signal
    (script,) = [p.read_text() for p in log.glob("job_*.sh")]
    for line in ("#SBATCH --array=0-1%", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --mem=64GB", "#SBATCH --time=240", "#SBATCH --nodes=1",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --signal=USR2@120"):
        assert line in script, script
    assert f"srun --unbuffered --output {sweep}/.submitit/%A_%a/%A_%a_%t_log.out" in script
    assert f"{sys.executable} -u -m submitit.core._submit" in script  # this environment's Python, on the node
    # each task ran one member, in the member's dir, and its record names the SLURM job it ran in
    records = sorted((record.read(p.parent) for p in sweep.glob(f"*/{record.FILE}")), key=lambda r: r["seed"])
    assert [r["seed"] for r in records] == [0, 1]
    for task, rec in enumerate(records):  # the sweep's order: task i ran member i
        assert rec["status"] == "finished", rec["error"]
        assert rec["provenance"]["slurm_job_id"] == f"4242_{task}"
        assert json.loads((log / f"env_4242_{task}.json").read_text())["SLURM_ARRAY_TASK_ID"] == str(task)
    assert "2 members, 2 finished" in (sweep / "report.md").read_text()
