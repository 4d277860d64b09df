"""Reading a run directory: its state, progress and logs (`rltools status`, `logs`, `cancel`, `plot`).

Invariant: everything here works from the run directory alone, whether the job was submitted by
`rltools submit`, by hand with `sbatch` of the rendered script, or ran under the local launcher,
and it needs no accounting database: Slurm's state comes from `launch.slurm.job_state`, progress
from metrics.jsonl and eval/, and which component failed from the exit files the job script writes.
The package sits above `rltools.launch` (it reads the lock and Slurm's state) and launch never
imports it: the launcher is handed its progress display by its caller.

Import from the submodules: `status` (the run's state), `logs` (task logs) and `progress` (the live
display and its step line); metrics and evaluation results are read by `rltools.records`.
"""
