"""Training curves from a run's metrics (``slide train --plot``, ``slide plot METRICS.json``)."""
from __future__ import annotations

__all__ = ["plot_metrics"]


def plot_metrics(doc: dict, path: str, title: str | None = None) -> None:
    """Draw loss and P@k per epoch from a metrics document (``--metrics-json``'s content:
    ``{"epochs": [record, ...], ...}``) into the image file ``path`` (PNG, SVG, PDF by suffix).

    Needs matplotlib (``pip install "slide-xmc[plot]"``).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib "
                           "(or the package's 'plot' extra)") from None
    epochs = doc.get("epochs") if isinstance(doc, dict) else None
    if not epochs or not all(isinstance(r, dict) and "epoch" in r for r in epochs):
        raise ValueError("no per-epoch records to plot (expected {'epochs': [{'epoch': ...}, ...]})")
    x = [r["epoch"] for r in epochs]
    fig, (ax_loss, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("loss", "train loss (epoch mean)"), ("val_loss", "validation loss")):
        if any(key in r for r in epochs):
            ax_loss.plot(x, [r.get(key) for r in epochs], marker="o", ms=3, label=label)
    for key in ("val_P@1", "val_P@5", "test_P@1", "test_P@3", "test_P@5"):
        if any(key in r for r in epochs):
            ax_p.plot(x, [r.get(key) for r in epochs], marker="o", ms=3, label=key.replace("_", " "))
    stop = doc.get("stopping") or {}
    if stop.get("kept_epoch"):
        for ax in (ax_loss, ax_p):
            ax.axvline(stop["kept_epoch"], color="grey", ls="--", lw=1, label="kept epoch")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("cross-entropy")
    ax_p.set_xlabel("epoch")
    ax_p.set_ylabel("precision")
    for ax in (ax_loss, ax_p):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or f"{doc.get('n_train', '?')} training rows, {doc.get('n_labels', '?')} labels")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
