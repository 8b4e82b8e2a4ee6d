"""Training a model: the recipe (`recipe`), its engines (`engines`: the in-memory reference
and the offload engine), where and with how much memory a job computes (`resources`: threads,
device, budget), the base model (`base_model`), base models larger than memory (`streamed`),
versions that continue an earlier one (`continued`), the base model's own answers mixed in
against forgetting (`replay`) and the machine's measured speed for the planner
(`machine_profile`). Every CUDA call of the worker side is here or in `offload/`."""
