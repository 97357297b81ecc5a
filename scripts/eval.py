"""Evaluate a checkpoint on any split, with nothing but the checkpoint (the same as `mhalab-eval`).

    python scripts/eval.py ckpt_path=outputs/<run> [split=test] [data_dir=DIR] [batch_size=N] [out=m.json]

The work is mhalab.train.commands.evaluate's; the options are conf/eval.yaml's (Hydra key=value).
"""

from mhalab.cli import evaluate as main
from mhalab.train.commands.evaluate import evaluate  # noqa: F401  (the library function, importable from here too)

if __name__ == "__main__":
    main()
