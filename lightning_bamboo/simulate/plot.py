"""The replay's figure: alive nodes and throughput over time, one line per system."""

from __future__ import annotations

from pathlib import Path

from lightning_bamboo.simulate.model import Result


def throughput_series(result: Result) -> tuple[list[float], list[float]]:
    """Samples/s between consecutive timeline points (a rollback shows as a dip below zero, clipped)."""
    times, rates = [], []
    last_t, last_samples = 0.0, 0.0
    for t, _, samples in result.timeline:
        if t > last_t:
            times.append(t)
            rates.append(max((samples - last_samples) / (t - last_t), 0.0))
        last_t, last_samples = t, samples
    return times, rates


def save_plot(results: list[Result], path: str | Path, title: str, time_unit_s: float = 3600.0) -> Path:
    """Write a two-panel PNG: nodes paid for over time (top), training throughput over time (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = "h" if time_unit_s == 3600.0 else "s"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for result in results:
        top.step([t / time_unit_s for t, _, _ in result.timeline], [n for _, n, _ in result.timeline],
                 where="post", label=result.system)
        times, rates = throughput_series(result)
        bottom.plot([t / time_unit_s for t in times], rates, label=result.system)
    top.set_ylabel("nodes")
    bottom.set_ylabel("samples/s")
    bottom.set_xlabel(f"time ({unit})")
    top.legend()
    top.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
