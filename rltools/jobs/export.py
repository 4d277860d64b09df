"""`rltools export`: one trainer checkpoint of a run written as a PEFT adapter or a merged Hugging Face
model, and checked with vLLM, in this process (here, or as the task of a Slurm job).

Invariant: light at import, like `rltools.jobs.eval` (the login side pickles `run_export` for
submitit); torch is imported once the checkpoint is found, vLLM only for the check.
"""

import contextlib
import os
from pathlib import Path

from ..config.schema import RLConfig
from ..paths import RunPaths
from ..policy_exports import resolve_checkpoint


def run_export(config: RLConfig, paths: RunPaths, checkpoint: str, fmt: str, output: Path | None = None, *,
               force: bool = False, verify: bool = True, quantize: str | None = None, shard_bytes: int = 1 << 30,
               progress: bool = True, engine_output=contextlib.nullcontext) -> dict:
    """Export trainer checkpoint `checkpoint` (latest, step_N) of the run at `paths` as `fmt` (adapter,
    merged) to `output` (default: RUN_DIR/exports/step_N-<fmt>); with `verify`, vLLM checks it first
    (its output inside `engine_output()`). Returns the export's summary (`export.write.EXPORT_INFO`)."""
    from ..export.write import default_name, export_policy

    policy = resolve_checkpoint(paths, checkpoint, exports=False)
    for name, value in config.cluster.environment.items():  # the environment the run's roles had
        os.environ.setdefault(name, value)
    out = Path(output) if output is not None else paths.export_dir(default_name(policy, fmt, quantize))
    if verify:
        from ..export.serve import trainer_probe

        probe = trainer_probe(paths, policy)  # now: before the long part, and while a running trainer keeps it

    def check(directory: Path) -> dict:
        from ..export.serve import judge, score_export

        with engine_output():
            score = score_export(config, probe, directory, policy.step)
        return judge(score, policy, quantized=quantize is not None)

    return export_policy(config, paths.root, policy, fmt, out, force=force, quantize=quantize,
                         verify=check if verify else None, shard_bytes=shard_bytes, progress=progress)
