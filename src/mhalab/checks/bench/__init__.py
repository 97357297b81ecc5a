"""Speed and memory of our attention / encoder against PyTorch's, weights copied (`mhalab-bench`, `make bench`).

    mhalab-bench quick=true targets=true   # ~2-3 min on a 2-core CPU, with the issue's checks
    mhalab-bench threads=1 clock=cpu       # full sweep, L = 64..2048 on CPU, on a shared machine
    mhalab-bench device=cuda               # bf16 autocast, L = 128..8192, TFLOP/s and MFU
Writes bench.json, bench.md and bench.png to results/bench/<device-name>/ (or out=DIR). Every option:
`mhalab-bench --help` (config.BenchConfig).

What is compared, for each module, sequence length L and batch B:
  * `weights`  our module on the explicit path: MultiHeadAttention(need_weights=True), which forms
               the (B, H, L, L) weight matrix. Encoder layers call their attention with
               need_weights=False; theirs is built with from_official(explicit=True), which still
               takes the explicit path.
  * `fused`    our module as it ships: need_weights=False -> F.scaled_dot_product_attention.
  * `official` nn.MultiheadAttention / nn.TransformerEncoderLayer / nn.TransformerEncoder with the same
               weights (from_official), called the way a user calls them (need_weights=False for the
               bare attention, nested tensors enabled for the encoder stack: PyTorch's defaults).
Modules: `attn` (self-attention), `layer` (one post-norm encoder layer), `enc` (a stack, layers=N).
Modes:   `fwd`   train mode, forward only, autograd recording (what a training forward costs);
         `train` forward + backward of a training step (loss = sum of the outputs, grads set to None
                 before each step as `optimizer.zero_grad()` does);
         `infer` eval mode under torch.inference_mode().
Padding: each batch has a key-padding mask (right padding, lengths spread evenly over
         [L - 2*pad_frac*L, L], so that pad_frac of all positions are padding: a quarter by default,
         as in a real unbucketed batch). `pad_frac=0` passes no mask at all.

Measurements:
  * time: median wall time of `reps` repetitions after `warmup` ones. Variants are interleaved
    (weights, fused, official, weights, fused, ...) so that load from other processes on a shared
    machine hits them alike; ratios are to the official module of the same row.
  * peak memory: the most bytes of tensors live at once during one call, above what was live
    before it (inputs and parameters are not counted; activations saved for backward, gradients and
    temporaries are). CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus
    memory_allocated() before. CPU: there is no allocator peak counter, so one extra call runs under
    torch.profiler(profile_memory=True), which records every CPU tensor allocation and free with
    its size; the peak of their running sum is the number reported (allocator caching and
    fragmentation are not included; it is the live-tensor peak).
  * FLOPs (CUDA, or CPU with peak_tflops=N): counted analytically, matmuls only, on the useful work:
    projections 2*N*E*4E, feed-forward 2*N*E*F*2 (N = real tokens), attention 2*E*sum_b(len_b^2)*2
    (QK^T and AV over real query/key pairs); x3 for forward+backward. Every variant is credited the
    same FLOPs, so TFLOP/s ratios are time ratios; MFU = TFLOP/s / peak_tflops.
On CUDA, the models keep float32 parameters and run under torch.autocast(bfloat16).

Files: cases (the variants and their inputs), measure (time, peak memory), targets (the issue's
checks), render (markdown, png, console), config (the key=value options), command (main).
"""

from mhalab.checks.bench.command import main

__all__ = ["main"]
