"""What the demo shows at the end: the table of held-out losses, the seed-spread check, the plot."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StudentResult:
    """One finished student run."""

    kind: str  # "kd" or "ce"
    seed: int
    heldout_loss: float  # mean CE per token on the held-out split, at the last step
    wall_s: float
    metrics: list[dict] = field(repr=False, default_factory=list)


@dataclass
class GroupStats:
    losses: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses)

    @property
    def spread(self) -> float:
        """max - min over seeds."""
        return max(self.losses) - min(self.losses)


def group(results: list[StudentResult], kind: str) -> GroupStats:
    return GroupStats([r.heldout_loss for r in sorted(results, key=lambda r: r.seed) if r.kind == kind])


def kd_beats_ce(kd: GroupStats, ce: GroupStats) -> bool:
    """KD is better by more than the seeds scatter either group: the worst KD seed's plausible range
    (mean + spread) stays below the best CE seed's (mean - spread)."""
    return kd.mean + kd.spread < ce.mean - ce.spread


def loss_table(*, teacher_loss: float, teacher_params: int, student_params: int, results: list[StudentResult],
               seeds: tuple[int, ...], uniform_loss: float) -> str:
    seed_columns = [f"seed {s}" for s in seeds]
    header = ["model", "params", *seed_columns, "mean", "spread"]
    rows = [["teacher", _count(teacher_params), *["-"] * len(seeds), f"{teacher_loss:.4f}", "-"]]
    for kind, label in (("kd", "student, KD"), ("ce", "student, CE only")):
        by_seed = {r.seed: r.heldout_loss for r in results if r.kind == kind}
        stats = group(results, kind)
        rows.append([label, _count(student_params), *[f"{by_seed[s]:.4f}" for s in seeds], f"{stats.mean:.4f}",
                     f"{stats.spread:.4f}"])
    rows.append(["uniform guess (ln V)", "-", *["-"] * len(seeds), f"{uniform_loss:.4f}", "-"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def plot_curves(results: list[StudentResult], teacher_loss: float, path: Path, title: str) -> Path | None:
    """Training CE and held-out CE against step, KD vs CE-only students; None if matplotlib is missing.

    The KD students' training loss mixes KD and CE terms; the CE term alone is what
    both kinds share, so that is what the left panel plots.
    """
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    colors = {"kd": "tab:blue", "ce": "tab:orange"}
    labels = {"kd": "KD student", "ce": "CE-only student"}
    styles = ["-", "--", ":", "-."]
    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    seeds = sorted({r.seed for r in results})
    for r in sorted(results, key=lambda r: (list(colors).index(r.kind), r.seed)):
        style = styles[seeds.index(r.seed) % len(styles)]
        label = f"{labels[r.kind]}, seed {r.seed}"
        steps = [m["step"] for m in r.metrics]
        train_ax.plot(steps, _smooth([m["ce"] for m in r.metrics]), style, color=colors[r.kind], label=label,
                      linewidth=1.3)
        evals = [(m["step"], m["eval_ce"]) for m in r.metrics if "eval_ce" in m]
        eval_ax.plot(*zip(*evals), style, marker="o", markersize=3.5, color=colors[r.kind], label=label,
                     linewidth=1.3)
    for ax in (train_ax, eval_ax):
        ax.axhline(teacher_loss, color="tab:green", linestyle="-.", linewidth=1.2,
                   label=f"teacher, held-out ({teacher_loss:.3f})")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
    train_ax.set_title("training CE (moving average of 10 steps)")
    eval_ax.set_title("held-out CE")
    # The first steps start near ln V; zoom on where the runs separate.
    finals = [r.heldout_loss for r in results] + [teacher_loss]
    eval_values = [m["eval_ce"] for r in results for m in r.metrics if "eval_ce" in m]
    low = min(finals) - 0.15
    eval_ax.set_ylim(low, max(eval_values) + 0.1)
    train_ax.set_ylim(low, max(eval_values) + 0.5)
    for ax in (train_ax, eval_ax):
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(values: list[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
