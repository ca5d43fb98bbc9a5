"""The plots of ``bench.py --sim`` (PNGs under ``--plots``): TTFT p95 against arrival rate per
router and TTFT CDFs, each titled as a simulation with its profile."""

from __future__ import annotations

from pathlib import Path

from bench.fleet.runs import sim_label
from serve_app.common.sim_profile import SimProfile


def plot(results: dict, profile: SimProfile, slo: tuple[float, float], out: Path
         ) -> list[Path]:
    """PNGs: TTFT p95 against arrival rate per router, and TTFT CDFs (each titled as a
    simulation with its profile)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("many-adapters", "sessions"):
        if name not in results:
            continue
        r = results[name]
        unit = "requests/s" if name == "many-adapters" else "conversations/s"
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        for router, by_rate in r["routers"].items():
            rates = sorted(by_rate)
            left.plot(rates, [by_rate[x]["ttft_p95_s"] for x in rates], marker="o",
                      label=f"{router} (goodput {r['goodput'][router]:g})")
        left.axhline(slo[0], color="grey", linestyle="--", label=f"SLO {slo[0]:g} s")
        left.set(xlabel=f"arrival rate ({unit}, Poisson)", ylabel="TTFT p95 (s)",
                 yscale="log", title="TTFT p95 against arrival rate")
        left.legend(fontsize=8)
        # where the default router leaves the SLO (or the grid's top)
        at = min([x for x in r["rates"] if x > r["goodput"]["default"]], default=r["rates"][-1])
        for router, by_rate in r["routers"].items():
            ttft = by_rate[at]["ttft_s"]
            right.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=router)
        right.set(xlabel="TTFT (s)", ylabel="share of requests", xscale="log",
                  title=f"TTFT CDF at {at:g} {unit}")
        right.legend(fontsize=8)
        fig.suptitle(f"{name}: {sim_label(profile)} ({profile.description[:70]})", fontsize=9)
        fig.tight_layout()
        path = out / f"sim-{profile.name}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if "tenants" in results:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        runs = results["tenants"]["runs"]
        idle = runs["idle"]["light_ttft_p95_s"]
        for label, run in runs.items():
            ttft = run["ttft_s"]
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))],
                    label=f"{label}: p95 x{run['light_ttft_p95_s'] / idle:.2f} idle")
        ax.axvline(2 * idle, color="grey", linestyle="--", label="goal: p95 <= 2x idle")
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=0.8)
        ax.set(xlabel="light tenants' TTFT (s)", ylabel="share of requests", xscale="log",
               title=f"tenants: {sim_label(profile)}")
        ax.legend(fontsize=7, loc="center")
        fig.tight_layout()
        path = out / f"sim-{profile.name}-tenants.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
