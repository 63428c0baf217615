"""Loss curves of the GPT-2 example's runs (the metrics JSON that train.py writes), as one PNG.

matplotlib is imported only here, and only when a plot is asked for: a machine without it still trains
(and says so). `python examples/gpt2/plot.py OUT.png RUN.json [RUN.json ...]` plots saved runs.
"""
from __future__ import annotations

import json
import sys

COLORS = {"jnova": "tab:blue", "xla": "tab:orange"}


def plot_loss_curves(metric_files: list[str], png: str, title: str = "") -> bool:
    """Training loss (thin) and validation loss (markers) per step of each run; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot {png}: matplotlib is not installed; pip install matplotlib==3.11.2)", flush=True)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles, seeds = ["-", "--", ":", "-."], {}
    for path in metric_files:
        with open(path) as f:
            run = json.load(f)
        rows = run["rows"]
        label = f"{run['compiler']} seed {run['seed']}"
        color = COLORS.get(run["compiler"])
        style = styles[seeds.setdefault(run["seed"], len(seeds)) % len(styles)]   # one line style per seed
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, color=color, lw=0.8, alpha=0.6,
                label=f"{label} (train)")
        vals = [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None]
        if vals:
            ax.plot(*zip(*vals), style, marker="o", ms=3, color=color, lw=1.5, label=f"{label} (validation)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sys.exit(0 if plot_loss_curves(sys.argv[2:], sys.argv[1]) else 1)
