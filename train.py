"""Train a Transformer-encoder text classifier.

    python train.py                          # custom encoder on SST-2
    python train.py model=official heads=8   # PyTorch's encoder, 8 heads
    python train.py -m heads=1,2,4,8,16 seed=0,1,2   # a sweep, report at the end
"""

import hydra
from omegaconf import DictConfig

import mhalab.config  # noqa: F401  (registers the ${repo_root:}, ${mul:}, ${run_id:} resolvers)
from mhalab.cli import one_line_errors
from mhalab.train import run


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@one_line_errors
def main(cfg: DictConfig) -> float:
    return run(cfg)


if __name__ == "__main__":
    main()
