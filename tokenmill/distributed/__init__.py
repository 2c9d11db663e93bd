"""Tensor parallelism over torch.distributed: group.py (the process group and collectives),
sharding.py (what each rank holds), parallelize.py (the layers' collectives), worker.py (the
ranks other than 0) and executor.py (the driver's side)."""
