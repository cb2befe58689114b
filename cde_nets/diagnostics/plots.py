"""Figures of diagnostic results (matplotlib imported lazily: the library does not require it)."""

from __future__ import annotations

from typing import Any


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from exc
    return plt


__all__ = ["plot_energy", "plot_bsm", "plot_profile", "plot_adjoint_study"]


def plot_energy(result: dict, ax: Any = None):
    """Batch-mean ``H(t)`` and extended energy from :func:`energy_trajectory` (or ``aF`` from adjoint_state)."""
    plt = _plt()
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots()
    x = result.get("times", range(len(result["H" if "H" in result else "aF"])))
    for key in ("H", "extended", "aF", "aF_extended"):
        if key in result:
            ax.plot(list(x), result[key].mean(-1).tolist(), label=key)
    ax.set_xlabel("t")
    ax.legend()
    return fig


def plot_bsm(result: dict, ax: Any = None):
    """``min/mean/max ‖Φ‖₂`` against ``ℓ`` (discrete) or ``t`` (continuous), log scale."""
    plt = _plt()
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots()
    x = result["ell"] if "ell" in result else result["t"]
    for key in ("min", "mean", "max"):
        ax.semilogy(list(x), result[key].tolist(), label=key)
    ax.set_xlabel("ℓ" if "ell" in result else "t")
    ax.set_ylabel("‖Φ‖₂")
    ax.legend()
    return fig


def plot_profile(profile: dict, ax: Any = None):
    """Every curve of a :func:`depth_profile` dict against the layer index."""
    plt = _plt()
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots()
    for key, v in profile.items():
        if hasattr(v, "tolist") and getattr(v, "dim", lambda: 0)() == 1:
            ax.plot(v.tolist(), label=key)
    ax.set_xlabel("layer")
    ax.legend()
    return fig


def plot_adjoint_study(study: dict, ax: Any = None):
    """Relative gradient error against forward+backward NFE, one series per (mode, method)."""
    plt = _plt()
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots()
    series: dict[tuple, list] = {}
    for r in study["rows"]:
        if r.get("rel_grad_error") is not None:  # refused and failed cells have no numbers
            series.setdefault((r["mode"], r["method"]), []).append(
                (r["nfe_forward"] + r["nfe_backward"], r["rel_grad_error"])
            )
    for (mode, method), pts in series.items():
        pts.sort()
        ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{mode} {method}")
    ax.set_xlabel("NFE forward + backward")
    ax.set_ylabel("relative gradient error")
    ax.legend()
    return fig
