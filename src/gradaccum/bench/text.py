"""The report's fixed prose: what each section measures and how. No measured number lives here."""

from __future__ import annotations

__all__ = ["EXACTNESS_NOTES", "INTRO", "MALLOC_NOTE", "OVERHEAD_NOTES", "RESIDENT_NOTES"]

INTRO = (
    "Three questions, answered side by side with what a user would pick instead: does gradaccum "
    "cost time, does it cost memory, and is it exact. Contenders run interleaved in one process; "
    "times are medians after a warm-up round; ratios are against the hand-written loop. "
    "`gradaccum bench --smoke` checks, in seconds, that the benchmark runs."
)

OVERHEAD_NOTES = [
    "- **hand-written**: nanoGPT's micro-step loop: `(loss / N).backward()` per micro-batch, then "
    "`optimizer.step()` and `optimizer.zero_grad(set_to_none=True)`.",
    "- **gradaccum**: `acc = Accumulator(optimizer, N, model=model)`, `acc.backward(loss)` per "
    "micro-batch.",
    "- **accelerate**: Hugging Face Accelerate as its gradient-accumulation guide shows it: "
    "`Accelerator(gradient_accumulation_steps=N)`, `prepare(model, optimizer)`, and per "
    "micro-batch `with accelerator.accumulate(model):` `accelerator.backward(loss)`, "
    "`optimizer.step()`, `optimizer.zero_grad()`.",
    "- Same model from the same weights, AdamW (lr 1e-3), cross-entropy, the same micro-batches "
    "(tensors in memory: no DataLoader, whose cost is not accumulation's). The MLP trains on "
    "MNIST images, the CNNs on random inputs of their shape (bench-cnn: 3x64x64, 10 classes).",
    "- Time: one sample is the mean time per optimizer step over a few windows (the windows per "
    "sample column; about a second's worth); the order of the contenders rotates every round. "
    "Ratio: median over the hand-written loop's median; in brackets the quartiles of the "
    "per-round ratios, a measure of the noise.",
    "- Memory: the allocator peak while building the model and training one window (after a "
    "window of one-item micro-batches, which allocates the optimizer's state). On CPU, the "
    "running sum of the PyTorch profiler's memory events "
    "(`profile_memory=True`: one event per allocation and per free); on CUDA, "
    "`torch.cuda.max_memory_allocated`. A difference of a few bytes is gradaccum's window loss: "
    "it keeps each micro-batch's detached loss (a 0-dim tensor) until the boundary sums them "
    "into `window_loss`, which stays readable until the next boundary.",
]

MALLOC_NOTE = [
    "On CPU, a large micro-batch's activations are large blocks, which glibc's malloc serves "
    "with `mmap` and hands back to the OS when they are freed: the next micro-batch faults every "
    "page in again (the page-fault column), and that can take longer than the arithmetic. "
    "`MALLOC_MMAP_MAX_=0` (no `mmap`) and a large `MALLOC_TRIM_THRESHOLD_` (no trimming) keep "
    "freed memory in the heap for the next micro-batch; the tuned-malloc columns time the same "
    "windows in a process started with them, alternating with this one's. glibc reads these "
    "variables when a process starts, "
    "so set them in the environment of the command, e.g. "
    "`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 gradaccum train ...`; the price is "
    "that the process keeps its peak memory resident. They do not affect a GPU's memory.",
]

EXACTNESS_NOTES = [
    "Max |parameter difference| against full-batch training, in float64 with SGD (lr 0.1), so "
    "that float rounding (about 1e-17) and a wrong normalization (1e-3 and up) cannot be confused.",
    "",
    "- **uneven**: the MNIST MLP, 80 images in micro-batches of 8, windows of 4: the last window "
    "holds 2 micro-batches. The full batch steps on 32, 32 and 16 images.",
    "- **tokens**: a small language model on padded sequences (24 sequences of 1 to 12 real "
    "tokens, micro-batches of 3, windows of 4), a token-mean cross-entropy: the full batch is the "
    "mean over each window's real tokens.",
    "- **gradaccum**: `acc.backward(loss)` and `acc.flush()` at the end of the data; with "
    "`n_items` = the micro-batch's real tokens in the token case.",
    "- **accelerate**: the guide's usage (above) over a prepared DataLoader. "
    "`accelerator.backward` divides every loss by N, and the DataLoader ends the last window at "
    "the end of the data (the default `sync_with_dataloader=True`), so a short last window is "
    "divided by N instead of by the micro-batches it holds; with tokens, the window is the mean "
    "of the micro-batches' means.",
    "- **accelerate-recipe**: the guide's section *Gradient accumulation on training samples of "
    "variable size*: pre-fetch the window's batches, count their items (`accelerator.gather`), "
    "and backward the sum-reduced loss times N (and the process count) over that count. Exact, "
    "at the price of loading a whole window before its first forward and writing the "
    "normalization by hand.",
    "- **naive**: `(loss / N).backward()`, a step every N micro-batches and at the end of the data.",
]

RESIDENT_NOTES = [
    "The seed's accumulator (its MindSpore tutorial), redone in PyTorch in "
    "`gradaccum.bench.seed`: it adds every micro-batch's gradients into `inner_grads` and, after "
    "each update, copies a second buffer, `zeros`, over it; both are the size of the trainable "
    "parameters and stay allocated for the whole run. gradaccum adds gradients up in `.grad` and "
    "frees them at each boundary (`zero_grad(set_to_none=True)`). Computed: twice the parameter "
    "bytes. Measured: bytes still allocated after a window, and the allocator peaks, the "
    "seed's minus gradaccum's (same model, micro-batches and AdamW).",
]
