"""Checks that run the code, as opposed to reading its runs back (mhalab.analysis): ours against PyTorch's modules
(compare: mhalab-compare), their speed and memory (bench: mhalab-bench), and the one-command GPU check that drives
the other commands on a lent GPU, with its bundle (gpu_check: scripts/gpu_check.py, scripts/gpu_bundle.py)."""
