"""torchyard's own entrypoints, each a function `(ctx: JobContext, **kwargs) -> JSON-able dict`.

- worker.tasks.seed:ddp_parameters, worker.tasks.seed:sampler_shards: the two founding
  demonstrations (DDP keeps replicas equal; DistributedSampler shards a dataset), returning checked
  results {"ok": bool, ...evidence}.
- worker.tasks.train:train: a small real training run with progress, checkpoints and resume.
- worker.tasks.faults: failures and waits on purpose, for the tests of the service and worker.
"""
