"""Each row's verdict against the reference code's spread (or the published number), and the footnotes that give
the cause of every row outside it, with what was tried.

A row is *within reference* when our mean lies within two of the reference code's standard deviations of its mean
(two or more reference seeds), else *within published* when the published number lies within our mean ± 2 sd or
our mean is above it. Otherwise it is *outside* and needs a footnote (:data:`FOOTNOTES`), or *not judged* where a
single seed of ours has no spread to compare.
"""

from __future__ import annotations

__all__ = ["FOOTNOTES", "verdict"]

# (reproduction, row setting) -> the cause found, or what was tried where none was.
FOOTNOTES: dict[tuple[str, str], str] = {
    ("hdnn_table1", "swiss roll, H1, 4 layers (test)"): (
        "Not found. Our H1 is the reference's H1_J1 step for step (J = [[0, −I], [I, 0]], forward Euler, K and b "
        "~ N(0, 1), R_K with h = T/L, the same read-out refits and epoch-counted Adam bias correction); the data "
        "generators agree up to the random draws; float32 in both. The reference code's spread here rests on two "
        "seeds (89.4 / 85.6 %), ours on five (74.8-87.0 %): its 5 seeds remain to be run before a cause is claimed."
    ),
    ("hdnn_table1", "swiss roll, H2, 8 layers (test)"): (
        "The reference code remains to be run at 8 layers. Ours is 76.5-86.5 % over seeds 0-4 with H2 in the "
        "reference's order (q first); p first gave 84.6 % on seed 0. The published 95.5 % is above every seed of "
        "ours; T = 1.2 at every depth as examples/run.py defaults (the paper does not give T per depth)."
    ),
    ("hdnn_table1", "double moons, H2, 2 layers (test)"): (
        "Cause found and fixed: the reference's H2 updates q from p first, eqs. H12-13 write p first; with the "
        "input in p and q the order changes what a 2-layer net fits. Seed 0 went from 86.35 % (p first) to "
        "99.95 %; over seeds 0-2 q first gives 99.95 / 93.2 / 85.7 % against 86.6 / 90.6 / 86.1 % p first."
    ),
    ("hdnn_fig4", "tanh MLP, 8 layers: test accuracy"): (
        "The reference code (run_MLP.py) on seeds 0-4 gives 94.3 ± 2.2 %, where ours lies; its published 99.7 % "
        "is not what it gives on these seeds. Checked against it: data (double moons in features 0 and 5 of R⁶), "
        "N(0, 1) init, weight decay 1e-4 · ½ Σ_{j<N−1}(‖K_j‖² + ‖b_j‖²), per-batch read-out refits, epoch-counted "
        "Adam bias correction. Tried its one remaining difference, the final read-out refit with the epoch-counted "
        "bias correction: 93.14 ± 1.48 % against 93.12 ± 1.51 % (seeds 0-4), no change."
    ),
    ("hdnn_table2", "swiss roll, centralised, 4 layers (test)"): (
        "Seed spread, in the reference code too: its run_distributed.py gives 73.9 / 85.9 % on seeds 0 / 1, ours "
        "72-89 % over seeds 0-4. The centralised net has full 8×8 blocks K_p, K_q ~ N(0, 1) and h = 0.5, so "
        "‖h K Kᵀ‖ ≈ 16 per layer at initialisation and training lands in one of a few basins: float rounding "
        "alone moves it (seed 0 gave 73.45 % in an earlier recording under torch's default two threads, 89.4 % "
        "under one). Tried the reference's own update (q first, J = [[0, I], [−I, 0]] as its H2_sparse): "
        "94.9 / 76.2 / 74.9 % on seeds 0-2, the same spread. The protocol behind the published 100 % is not in "
        "the paper or the code."
    ),
    ("hdnn_table2", "swiss roll, centralised, 3 layers (test)"): (
        "The reference code was run here at 4 layers only (where it agrees with ours); at 2-3 layers it remains to "
        "be run. Same cause as at 4 layers: full N(0, 1) blocks with h = 0.5 make the centralised net land in one "
        "of a few basins (79.8-94.0 % over seeds 0-4), while the ring-sparse net reaches 94.5-100 %."
    ),
    ("hdnn_table2", "swiss roll, centralised, 2 layers (test)"): (
        "As at 3 layers: the reference code remains to be run at 2 layers; ours 71.2-85.1 % over seeds 0-4 (an "
        "earlier single recording of seed 0 under two threads gave 97.0 %, one thread 77.5 %: the same rounding "
        "sensitivity)."
    ),
}


def verdict(row: dict) -> str | None:
    """``within reference``, ``within published``, ``outside`` (footnoted), or None where nothing is compared."""
    mean, ref, published = row.get("ours"), row.get("reference"), row.get("published")
    if not isinstance(mean, (int, float)):
        return None
    spread = bool(ref) and len(ref["values"]) > 1
    if spread and abs(mean - ref["mean"]) <= 2 * ref["sd"]:
        return "within reference"
    judged = isinstance(published, (int, float)) and row.get("unit") == "%"
    if judged and (mean >= published or abs(mean - published) <= 2 * row.get("sd", 0.0)):
        return "within published"
    if spread or (judged and row.get("n_seeds", 1) > 1):
        return "outside"
    return "not judged (one seed)" if judged else None
