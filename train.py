"""Train a Transformer-encoder text classifier (the same as the `mhalab-train` command).

    python train.py                          # custom encoder on SST-2
    python train.py model=official heads=8   # PyTorch's encoder, 8 heads
    python train.py -m heads=1,2,4,8,16 seed=0,1,2   # a sweep, report at the end
"""

from mhalab.cli import train

if __name__ == "__main__":
    train()
