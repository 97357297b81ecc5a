"""What runs produce, read back: sweep reports and verdicts, the LRA table, attention maps, loss curves,
speed and memory benchmarks."""
