"""`rltools plot`: what a run did, in one image — held-out quality first, then training reward, the
policy's health and where each step's time went.

Reads metrics.jsonl and eval/ only, so it works on a finished, failed or running run alike. A panel
appears only when it has something to show (no flat-zero KL when algorithm.kl_coef is 0, no
accuracy curve that repeats the reward); evaluation steps are marked on every panel, because the
step after one waits for the generator that evaluated (`sync_wait_s`). The format follows the
output's suffix (.png, .svg, .pdf).
"""

from pathlib import Path

from .config.schema import HELD_OUT
from .errors import UserError
from .records import read_evals, read_metrics, set_results
from .paths import RunPaths

TIMINGS = {"generation_s": "generation", "training_s": "training", "sync_s": "weight sync",
           "sync_wait_s": "generators busy (evaluating)", "wait_s": "waiting for rollouts"}
FAINT = 0.25


def plot_run(paths: RunPaths, output: Path) -> None:
    metrics = read_metrics(paths)
    if not metrics:
        raise UserError(f"{paths.metrics} has no steps yet: nothing to plot")
    import matplotlib

    matplotlib.use("Agg")  # files only: works on a login node without a display
    import matplotlib.pyplot as plt

    steps = [m["step"] + 1 for m in metrics]
    evals = by_set(read_evals(paths))
    panels = [p for p in (_held_out, _reward, _tools, _policy, _fleet, _timing) if p.wanted(metrics, evals)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.9 * len(panels)), sharex=True, squeeze=False)
    for panel, ax in zip(panels, axes[:, 0]):
        panel.draw(ax, steps, metrics, evals)
        for step in sorted({step for results in evals.values() for step in results}):
            ax.axvline(step, color="0.6", lw=0.6, ls=":", zorder=0)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer steps (dotted: evaluations)")
    fig.suptitle(_title(paths, metrics, evals))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(output, dpi=110)
    except ValueError as err:  # an unknown suffix
        raise UserError(f"cannot write {output}: {err}; use a .png, .svg or .pdf file name") from None
    finally:
        plt.close(fig)


def by_set(evals: dict[int, dict]) -> dict[str, dict[int, dict]]:
    """{set name: {step: summary}}, the headline set first."""
    sets: dict[str, dict[int, dict]] = {}
    for step, result in evals.items():
        for name, summary in set_results(result).items():
            sets.setdefault(name, {})[step] = summary
    return sets


def _title(paths: RunPaths, metrics: list[dict], evals: dict) -> str:
    title = f"{paths.root.name}: {len(metrics)} steps"
    name, results = next(iter(evals.items()), (None, {}))
    if len(results) >= 2:
        first, last = min(results), max(results)
        k, before, after = results[last]["k"], results[first]["avg_at_k"], results[last]["avg_at_k"]
        label = "held-out" if name == HELD_OUT else name
        title += f" | {label} avg@{k} {before:.3f} (step {first}) -> {after:.3f} (step {last}), " \
                 f"{100 * (after - before):+.1f} points"
    return title


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start): no look-ahead, no lag at the end
    beyond the window itself."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


class _held_out:
    """The headline: each eval set's avg@k with its standard error, and pass@k (one set: its maj@k too)."""

    @staticmethod
    def wanted(metrics, evals) -> bool:
        return bool(evals)

    @staticmethod
    def draw(ax, steps, metrics, evals):
        one = len(evals) == 1
        for i, (name, results) in enumerate(evals.items()):
            at = sorted(results)
            last = results[at[-1]]
            k, color = last["k"], f"C{(1 + 2 * i) % 10}"
            what = f"avg@{k} (mean accuracy of {k} samples) ± stderr" if one else \
                f"{name}: avg@{k} ± stderr ({last['n_problems']} problems)"
            ax.errorbar(at, [results[s]["avg_at_k"] for s in at], yerr=[results[s]["stderr"] for s in at], fmt="o-",
                        capsize=3, color=color, label=what)
            if all("pass_at_k" in results[s] for s in at) and k > 1:
                ax.plot(at, [results[s]["pass_at_k"] for s in at], "s--", color=color, ms=4, alpha=0.6,
                        label=f"pass@{k} (any of {k} correct)" if one else f"{name}: pass@{k}")
            if one and k > 1 and all("maj_at_k" in results[s] for s in at):
                ax.plot(at, [results[s]["maj_at_k"] for s in at], "d:", color="C2", ms=4,
                        label=f"maj@{k} (the majority answer)")
        ax.set_ylim(0, 1)
        name, results = next(iter(evals.items()))
        ax.set_title(f"held-out problems ({results[max(results)]['n_problems']})" if one and name == HELD_OUT
                     else "evaluation sets" if not one else f"{name} ({results[max(results)]['n_problems']} problems)")
        ax.legend(loc="lower right", fontsize=8)


class _reward:
    """Training reward, smoothed, over the raw per-step values; accuracy only when it differs."""

    @staticmethod
    def wanted(metrics, evals) -> bool:
        return True

    @staticmethod
    def draw(ax, steps, metrics, evals):
        window = max(1, len(metrics) // 30)
        for key, label, color in (("reward_mean", "reward", "C0"), ("accuracy", "accuracy", "C3")):
            values = [m[key] for m in metrics if key in m]
            if len(values) != len(metrics):
                continue
            if key == "accuracy" and all(abs(m["accuracy"] - m["reward_mean"]) < 1e-9 for m in metrics):
                continue  # a 0/1 reward: the accuracy is the same curve
            ax.plot(steps, values, color=color, lw=0.6, alpha=FAINT)
            ax.plot(steps, smooth(values, window), color=color, lw=1.6,
                    label=f"{label} (mean of {window} steps)" if window > 1 else label)
        ax.set_title("training samples")
        ax.legend(loc="lower right", fontsize=8)


class _tools:
    """Multi-turn runs: the share of samples that called a tool, and of calls that failed."""

    @staticmethod
    def wanted(metrics, evals) -> bool:
        return "tool_call_rate" in metrics[0]

    @staticmethod
    def draw(ax, steps, metrics, evals):
        window = max(1, len(metrics) // 30)
        for key, label, color in (("tool_call_rate", "samples calling a tool", "C9"),
                                  ("tool_error_rate", "calls that failed", "C3")):
            values = [m.get(key, 0.0) for m in metrics]
            ax.plot(steps, values, color=color, lw=0.6, alpha=FAINT)
            ax.plot(steps, smooth(values, window), color=color, lw=1.6, label=label)
        headline = next(iter(evals.values()), {})
        at = [s for s in sorted(headline) if "tool_call_rate" in headline[s]]
        if at:
            ax.plot(at, [headline[s]["tool_call_rate"] for s in at], "o", color="C9", label="held-out: calling a tool")
        ax.set_ylim(0, 1)
        ax.set_title("tool use")
        ax.legend(loc="center right", fontsize=8)


class _policy:
    """Entropy of the sampled tokens, and KL to the reference and the clipped fraction when not zero."""

    @staticmethod
    def wanted(metrics, evals) -> bool:
        return any(key in metrics[0] for key in ("entropy", "kl", "clip_frac"))

    @staticmethod
    def draw(ax, steps, metrics, evals):
        ax.plot(steps, [m.get("entropy", float("nan")) for m in metrics], color="C4", lw=0.9, label="entropy (nats/token)")
        ax.set_title("policy")
        right = None
        for key, label, color in (("kl", "KL to the reference", "C2"), ("clip_frac", "clipped fraction", "C3")):
            values = [m.get(key, 0.0) for m in metrics]
            if any(values):  # kl is 0 throughout when algorithm.kl_coef is 0
                right = right or ax.twinx()
                right.plot(steps, values, color=color, lw=0.9, label=label)
        lines, labels = ax.get_legend_handles_labels()
        if right is not None:
            more = right.get_legend_handles_labels()
            lines, labels = lines + more[0], labels + more[1]
        ax.legend(lines, labels, loc="upper right", fontsize=8)


class _fleet:
    """Runs whose generator engines changed (lost, replaced, joined): live engines after each step,
    and the samples generated for a lost engine's slots."""

    @staticmethod
    def wanted(metrics, evals) -> bool:
        return len({m.get("engines") for m in metrics} - {None}) > 1 or any(m.get("reassigned_samples") for m in metrics)

    @staticmethod
    def draw(ax, steps, metrics, evals):
        ax.step(steps, [m.get("engines", float("nan")) for m in metrics], where="post", color="C0",
                label="live generator engines")
        ax.set_ylim(0, max(m.get("engines", 1) for m in metrics) + 1)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title("generator fleet")
        right = ax.twinx()
        right.bar(steps, [m.get("reassigned_samples", 0) for m in metrics], color="C3", alpha=0.5,
                  label="samples generated for a lost engine")
        lines, labels = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines + more[0], labels + more[1], loc="lower left", fontsize=8)


class _timing:
    """Where each step's seconds went, stacked: the top edge is the step's wall time."""

    @staticmethod
    def wanted(metrics, evals) -> bool:
        return any(key in metrics[0] for key in TIMINGS)

    @staticmethod
    def draw(ax, steps, metrics, evals):
        keys = [key for key in TIMINGS if key != "generation_s" and any(m.get(key, 0) for m in metrics)]
        ax.stackplot(steps, *[[m.get(key, 0.0) for m in metrics] for key in keys],
                     labels=[TIMINGS[key] for key in keys], alpha=0.8)
        if "generation_s" in metrics[0]:  # generation overlaps training (asynchronous): a line, not a layer
            ax.plot(steps, [m["generation_s"] for m in metrics], color="k", lw=0.7, label="generation (overlapped)")
        ax.set_title("seconds per step (trainer)")
        ax.legend(loc="upper right", fontsize=8)
        totals = [sum(m.get(key, 0.0) for key in keys) for m in metrics]
        if len(totals) > 2 and totals[0] > 2 * max(totals[1:]):  # the first step also waits for start-up
            ax.set_ylim(0, 1.3 * max(totals[1:]))
            ax.annotate(f"step 1: {totals[0]:.0f} s (start-up)", (steps[0], 1.2 * max(totals[1:])), fontsize=8)
