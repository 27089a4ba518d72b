"""Several GPUs for one image, through `torch.distributed`: Ulysses sequence parallelism and CFG parallelism.

- `group`: joining the process group (NCCL on GPUs, gloo on CPU processes), the ranks' groups, timeouts,
  and `ParallelError`, the one-line error of a run that cannot start or go on.
- `ulysses`: `SequenceParallel`, a FLUX transformer whose tokens are split over ranks, with an
  all-to-all from token shards to head shards around each attention and back.
- `cfg`: the conditional and unconditional passes on two halves of the ranks, swapped once per step.
- `launch`: `flux-gen --gpus N` starting N ranks and ending them all, with one message, when one fails.

Import direction: pipeline → parallel → models → kernels. This file imports nothing, so that `flux-gen
--gpus N` starts its ranks without loading torch itself.
"""
