"""The PNG plots: goodput and latency against offered load; admitted share and TTFT per class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.shedbench.classes import ALONE, MIX, NO_RETRY, RETRY, ClassCell
from loadtest.shedbench.report import MixedResults, Results


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(res: Results, out: Path) -> list[Path]:
    """``<name>-goodput.png`` and ``<name>-latency.png`` (``overload``, or
    ``overload-<engine>`` on a real engine): thresholds off and on."""
    plt = _pyplot()
    paths: list[Path] = []
    series = {
        on: sorted((c for c in res.cells if c.thresholds == on), key=lambda c: c.load)
        for on in (False, True)
    }
    style = {False: ("thresholds off", "tab:red", "o"), True: ("thresholds on", "tab:blue", "s")}

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for on, cells in series.items():
        label, color, marker = style[on]
        xs = [c.load for c in cells]
        ax.plot(xs, [c.goodput_rps for c in cells], marker=marker, color=color,
                label=f"goodput, {label}")  # fmt: skip
        ax.plot(xs, [c.slo_goodput_rps for c in cells], marker=marker, color=color,
                linestyle="--", alpha=0.6, label=f"SLO goodput, {label}")  # fmt: skip
    ax.axhline(res.capacity_rps, color="grey", linestyle=":", label="capacity (knee)")
    ax.set_xlabel("offered load (x capacity)")
    ax.set_ylabel("goodput (completed 2xx req/s)")
    ax.set_title("Goodput against offered load")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title=f"SLO: TTFT <= {2 * res.unloaded_ttft_p99_ms:.0f} ms",
              title_fontsize=8)  # fmt: skip
    fig.tight_layout()
    paths.append(out / f"{res.config.name}-goodput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for on, cells in series.items():
        label, color, marker = style[on]
        xs = [c.load for c in cells]
        ax.plot(xs, [c.ttft_p99_ms for c in cells], marker=marker, color=color,
                label=f"TTFT p99, {label}")  # fmt: skip
        ax.plot(xs, [c.e2e_p99_ms for c in cells], marker=marker, color=color, linestyle="--",
                alpha=0.6, label=f"end-to-end p99, {label}")  # fmt: skip
    ax.axhline(2 * res.unloaded_ttft_p99_ms, color="grey", linestyle=":",
               label="2 x unloaded TTFT p99")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("offered load (x capacity)")
    ax.set_ylabel("latency of accepted requests (ms, log)")
    ax.set_title("Latency against offered load")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / f"{res.config.name}-latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


COLORS = {"critical": "tab:green", "standard": "tab:blue", "sheddable": "tab:orange"}


def _per_class(ax: Any, res: MixedResults, value: Any) -> None:
    """One line per class and client kind (never retry, retrying) against the load."""
    modes = {NO_RETRY: ("no retry", "-", "o"), RETRY: ("retrying", "--", "s")}
    for mode, (label, style, marker) in modes.items():
        cells = sorted((c for c in res.cells if c.mode == mode), key=lambda c: c.load)
        for name, _ in MIX:
            ax.plot(
                [c.load for c in cells], [value(c.of(name)) for c in cells],
                marker=marker, linestyle=style, color=COLORS[name], label=f"{name}, {label}",
            )  # fmt: skip


def class_plot(res: MixedResults, out: Path) -> list[Path]:
    """``classes-admitted.png`` and ``classes-ttft.png``: one line per class and client kind."""
    plt = _pyplot()
    paths: list[Path] = []

    def admitted(c: ClassCell) -> float:
        return 100 * c.admitted_ratio

    def ttft(c: ClassCell) -> float:
        return c.ttft_p99_ms

    for name, title, ylabel, value in (
        ("classes-admitted.png", "Admitted per class against offered load",
         "requests admitted (%)", admitted),
        ("classes-ttft.png", "TTFT p99 per class against offered load",
         "TTFT p99 of admitted requests (ms)", ttft),
    ):  # fmt: skip
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        _per_class(ax, res, value)
        if name == "classes-admitted.png":
            ax.axhline(95, color="grey", linestyle=":", label="95 %")
            ax.set_ylim(0, 105)
        else:
            alone = sorted((c for c in res.cells if c.mode == ALONE), key=lambda c: c.load)
            if alone:
                ax.plot(
                    [c.load for c in alone], [c.of("critical").ttft_p99_ms for c in alone],
                    marker="^", linestyle=":", color="black", label="critical alone",
                )  # fmt: skip
            ax.axhline(1.5 * res.unloaded_ttft_p99_ms, color="grey", linestyle=":",
                       label="1.5 x unloaded p99")  # fmt: skip
            ax.set_ylim(bottom=0)
        ax.set_xscale("log")
        ax.set_xlabel("offered load (x capacity, log)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
