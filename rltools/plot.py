"""`rltools plot`: a run's curves in one PNG — reward, accuracy (with held-out avg@k), KL, step timing.

Reads metrics.jsonl and eval/ only, so it works on a finished, failed or running run alike.
"""

from pathlib import Path

from .errors import UserError
from .monitor.records import read_evals, read_metrics
from .paths import RunPaths

TIMINGS = ("generation_s", "training_s", "sync_s", "wait_s")


def plot_run(paths: RunPaths, output: Path) -> None:
    metrics = read_metrics(paths)
    if not metrics:
        raise UserError(f"{paths.metrics} has no steps yet: nothing to plot")
    import matplotlib

    matplotlib.use("Agg")  # files only: works on a login node without a display
    import matplotlib.pyplot as plt

    steps = [m["step"] + 1 for m in metrics]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (reward, accuracy), (kl, timing) = axes
    reward.plot(steps, [m["reward_mean"] for m in metrics], lw=0.8)
    reward.set_title("training reward (mean)")
    accuracy.plot(steps, [m["accuracy"] for m in metrics], lw=0.8, label="training samples")
    evals = read_evals(paths)
    if evals:
        k = next(iter(evals.values()))["k"]
        accuracy.plot(list(evals), [e["avg_at_k"] for e in evals.values()], "o-", label=f"held-out avg@{k}")
        accuracy.errorbar(list(evals), [e["avg_at_k"] for e in evals.values()],
                          yerr=[e["stderr"] for e in evals.values()], fmt="none", capsize=3, color="C1")
    accuracy.set_title("accuracy")
    accuracy.legend()
    kl.plot(steps, [m.get("kl", 0.0) for m in metrics], lw=0.8)
    kl.set_title("KL to the reference policy")
    for key in TIMINGS:
        if key in metrics[0]:
            timing.plot(steps, [m[key] for m in metrics], lw=0.8, label=key.removesuffix("_s"))
    timing.set_title("seconds per step")
    timing.legend()
    for ax in (kl, timing):
        ax.set_xlabel("optimizer steps")
    fig.suptitle(f"{paths.root.name}: {len(metrics)} steps")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
