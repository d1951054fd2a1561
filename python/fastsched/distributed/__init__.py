"""Tensor parallelism's collectives: one model sharded over ``--tensor-parallel-size`` ranks
of a torch.distributed group (NCCL on CUDA, gloo on CPU), rank 0 being the engine process.

- :mod:`.parallel`: the rank's place in the group and the collectives the sharded model
  needs (all-reduce, the vocabulary gather);
- :mod:`.step_channel`: how a step's inputs reach the other ranks, once a step.

Starting, watching and stopping the other ranks is ``fastsched.worker.tp_group``'s job;
what each of them runs is ``fastsched.worker.tp_worker``.
"""
