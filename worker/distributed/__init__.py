"""One training job on several processes (and, later, machines): data parallel through the
offload engine, the ranks started by torchrun (torch.distributed's elastic agent).

spec.py   what the parent job hands its ranks (one JSON file in the job's folder)
rank.py   `python -m worker.distributed.rank SPEC`: one rank, run by torchrun
launch.py the parent's side: the torchrun command, its progress, cancel, and failures
"""
