"""`rltools eval`: avg@k / pass@k of one policy of a run, computed in this process with vLLM.

Invariant: the numbers are the generator's own evaluation (rltools.generate.loop.evaluate: same
problems, same per-problem seeds, same verifier) on the policy `resolve_checkpoint` names, served as
`export.serve.served_policy` serves it (a step only a trainer checkpoint holds is exported by the code
of `rltools export` first), so `--checkpoint step_N` reproduces what the run recorded in
eval/step_N.json for the same k.
"""

import os

from ..completions import write_eval_completions
from ..config.schema import RLConfig
from ..paths import RunPaths
from ..policy_exports import resolve_checkpoint


def run_eval(config: RLConfig, checkpoint: str = "latest", k: int | None = None, problems: int | None = None,
             paths: RunPaths | None = None) -> dict:
    """Evaluate policy `checkpoint` (base, latest, step_N) of the run at `paths` (default: config.run.dir)
    on every eval set; k and problems override each set's. Returns {"checkpoint", "step", "sets": {name:
    summary}} (a summary's keys: avg_at_k, stderr, k, pass_at_k, maj_at_k, n_problems,
    per_problem_accuracy, token statistics, sampling), and "completions": the directory that keeps them
    (eval/adhoc/step_N/, replacing the last `rltools eval` of that policy) when the run directory exists."""
    paths = paths or RunPaths(config.run.dir)
    policy = resolve_checkpoint(paths, checkpoint)
    for name, value in config.cluster.environment.items():  # the environment the run's roles had
        os.environ.setdefault(name, value)
    from ..data.eval_sets import eval_sets
    from ..data.tasks import load_tokenizer, make_task
    from ..export.serve import served_policy
    from ..generate.evaluation import evaluate

    task = make_task(config.data, config.reward, config.run.seed, config.model.path, load_tokenizer(config.model.path))
    sets = eval_sets(config.eval, config.data, config.reward, config.generator, task, k=k, count=problems)
    try:
        with served_policy(config, paths, policy) as engine:
            results, completions = evaluate(engine, sets, config.env, config.run.seed)
    finally:
        sets.close()
        task.reward.close()
    kept = {}
    if paths.config.is_file():  # a run directory (a CONFIG's base model may have none: nothing to keep it in)
        kept_in = paths.eval_samples_dir(policy.step, adhoc=True)
        write_eval_completions(kept_in, completions)
        kept = {"completions": str(kept_in)}
    return {"checkpoint": policy.name, "step": policy.step, "sets": results, **kept}
