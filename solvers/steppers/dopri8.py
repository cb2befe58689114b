r"""``dopri8``: Prince & Dormand's RK8(7)13M, as torchdiffeq 0.2.5 steps with it, and a continuous extension of
order seven for its dense output.

The pair: Prince & Dormand (1981), "High order embedded Runge-Kutta formulae", J. Comput. Appl. Math. 7, 67-75,
the 13-stage eighth-order formula with an embedded seventh-order one, in their rational approximations to the
coefficients (torchdiffeq's ``dopri8``: not Hairer's DOP853, whose nodes, weights and dense output differ).
torchdiffeq appends a fourteenth stage ``F(t_1, y_1)`` (weight 0 in both formulae) that the next step reuses, so
in its form the method is FSAL with ``s = 14``; here too, so that its steps are torchdiffeq's.

The dense output. torchdiffeq reads dopri8's outputs off a quartic through ``y_0``, ``y_1``, the end slopes and a
midpoint from the fifth-order extension of Bogacki & Shampine (1990, "Interpolating high-order Runge-Kutta
formulas", Comput. Math. Appl. 20); the quartic caps every output (``y(T)`` included, read off the last step,
which overshoots ``T``) at fourth order. The 14 stages admit no extension above order five: the conditions of
order six cannot all be met by weights on them (Hairer, Nørsett & Wanner, "Solving Ordinary Differential
Equations I", §II.6: ``Σ_i b_i(θ) Φ_i(τ) = θ^|τ| / γ(τ)`` for every tree ``τ``, eq. 6.11). So five stages are
added, each *bootstrapped* (Enright, Jackson, Nørsett & Thomsen 1986, "Interpolants for Runge-Kutta formulas",
ACM Trans. Math. Softw. 12, 193-218): a stage at node ``c`` whose row is the weights of a lower-order extension
at ``θ = c``, ``a_{new,j} = b_j(c)``, so that its slope is the field at an interpolated state:

- stages 15, 16 at ``c = 1/3, 2/3`` from a fifth-order extension over the 14 stages; with them the conditions of
  order six can be met;
- stages 17, 18, 19 at ``c = 3/10, 1/2, 7/10`` from the sixth-order extension over stages 1-16; with them, order
  seven, with weights on stages 1, 6-14 and 17-19 only.

The weights ``b_i(θ) = Σ_{p=1}^{7} d_{p,i} θ^p`` meet every condition of the 85 trees of at most seven vertices
for all ``θ``, with ``b_i(1) = b_i`` (the output is the step at its end), ``b_i'(0) = δ_{i,1}`` and
``b_i'(1) = δ_{i,14}`` (its slopes at the ends are the field's: the dense output is C¹ across steps), of least
Euclidean norm among those; the bootstrapped rows are the least-norm extensions of their orders (without stages
2-5, whose weights vanish in the step too). Solved here in 40-digit arithmetic (by singular value decomposition,
the near-null directions that the published rational approximations leave cut at 1e-13) and rounded to doubles;
:class:`~solvers.steppers.tableaux.MethodTableau` checks the order conditions again on construction. Over ``θ ∈ [0, 1]``
``Σ_i |b_i(θ)|`` stays at or below the step's own ``Σ_i |b_i| = 3.1``, and the principal error coefficients (the
order-eight defects) at most 2.3e-5, against 1.1e-4 for the embedded seventh-order formula.

Its cost is five field evaluations for a step that holds an output time (none otherwise): DOP853's own
seventh-order extension takes three.
"""

from __future__ import annotations

from .butcher import MethodTableau, Tableau

__all__ = ["DOPRI8"]

# fmt: off
_B = (
    14005451 / 335480064, 0.0, 0.0, 0.0, 0.0, -59238493 / 1068277825, 181606767 / 758867731, 561292985 / 797845732,
    -1041891430 / 1371343529, 760417239 / 1151165299, 118820643 / 751138087, -528747749 / 2220607170, 1 / 4, 0.0,
)
# the embedded seventh-order weights
_B7 = (
    13451932 / 455176623, 0.0, 0.0, 0.0, 0.0, -808719846 / 976000145, 1757004468 / 5645159321, 656045339 / 265891186,
    -3867574721 / 1518517206, 465885868 / 322736535, 53011238 / 667516719, 2 / 45, 0.0, 0.0,
)
_A = (
    (),
    (1 / 18,),
    (1 / 48, 1 / 16),
    (1 / 32, 0.0, 3 / 32),
    (5 / 16, 0.0, -75 / 64, 75 / 64),
    (3 / 80, 0.0, 0.0, 3 / 16, 3 / 20),
    (29443841 / 614563906, 0.0, 0.0, 77736538 / 692538347, -28693883 / 1125000000, 23124283 / 1800000000),
    (
        16016141 / 946692911, 0.0, 0.0, 61564180 / 158732637, 22789713 / 633445777, 545815736 / 2771057229,
        -180193667 / 1043307555,
    ),
    (
        39632708 / 573591083, 0.0, 0.0, -433636366 / 683701615, -421739975 / 2616292301, 100302831 / 723423059,
        790204164 / 839813087, 800635310 / 3783071287,
    ),
    (
        246121993 / 1340847787, 0.0, 0.0, -37695042795 / 15268766246, -309121744 / 1061227803,
        -12992083 / 490766935, 6005943493 / 2108947869, 393006217 / 1396673457, 123872331 / 1001029789,
    ),
    (
        -1028468189 / 846180014, 0.0, 0.0, 8478235783 / 508512852, 1311729495 / 1432422823,
        -10304129995 / 1701304382, -48777925059 / 3047939560, 15336726248 / 1032824649,
        -45442868181 / 3398467696, 3065993473 / 597172653,
    ),
    (
        185892177 / 718116043, 0.0, 0.0, -3185094517 / 667107341, -477755414 / 1098053517,
        -703635378 / 230739211, 5731566787 / 1027545527, 5232866602 / 850066563, -4093664535 / 808688257,
        3962137247 / 1805957418, 65686358 / 487910083,
    ),
    (
        403863854 / 491063109, 0.0, 0.0, -5068492393 / 434740067, -411421997 / 543043805,
        652783627 / 914296604, 11173962825 / 925320556, -13158990841 / 6184727034, 3936647629 / 1978049680,
        -160528059 / 685178525, 248638103 / 1413531060, 0.0,
    ),
    _B[:-1],
)
_C = (
    0.0, 1 / 18, 1 / 12, 1 / 8, 5 / 16, 3 / 8, 59 / 400, 93 / 200, 5490023248 / 9719169821, 13 / 20,
    1201146811 / 1299019798, 1.0, 1.0, 1.0,
)
# fmt: on

# fmt: off
_DENSE_STAGES = (
    (1 / 3, (
        0.048930893732309265, 0.0, 0.0, 0.0, 0.0, 0.08488001053286597, 0.21024417835644188, 0.022121297249238725,
        -0.019349505724347345, -0.02566625635940119, 0.02829233124662445, -0.0053732052334661395,
        -0.005373205233466121, -0.00537320523346615,
    )),
    (2 / 3, (
        0.047073483940405766, 0.0, 0.0, 0.0, 0.0, 0.16609606224070397, 0.21587140623249304, 0.11688911991120632,
        0.07009214946379527, 0.04344338780226127, 0.017123750302379368, -0.0033075644088594496,
        -0.003307564408859436, -0.0033075644088594583, 0.0,
    )),
    (3 / 10, (
        0.045870691060470814, 0.0, 0.0, 0.0, 0.0, 0.03257867503242265, 0.21351739215198945, -0.0003631997690940556,
        -0.012054159856444988, -0.021308161799414218, -0.0029473127457361505, 0.017715755725838174,
        -0.003734395079370386, -0.01257432804521316, 0.016291371662275955, 0.02700767166227591,
    )),
    (1 / 2, (
        0.04758938817075802, 0.0, 0.0, 0.0, 0.0, 0.0721915123003711, 0.20463391762725214, 0.03803767380511865,
        0.020523203159044275, 0.010798790552478075, -0.003944742803821679, 0.0034683901744588207,
        -0.006068168471867129, 0.004802282388284401, 0.11726512654896158, -0.009297373451038251, 0.0,
    )),
    (7 / 10, (
        0.04741140399135431, 0.0, 0.0, 0.0, 0.0, 0.11129172677372341, 0.20739301683632697, 0.08385287473481891,
        0.05999319478261448, 0.03320778545303625, -0.011099337026251125, -0.0019510065212936586,
        -0.018793196890959794, 0.02616971653498974, 0.07590376066582015, 0.08662006066582037, 0.0, 0.0,
    )),
)
_DENSE = (
    (  # θ^1
        1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
    ),
    (  # θ^2
        -7.9388132750082, 0.0, 0.0, 0.0, 0.0, 10.472941621405754, 17.86575356909015, 4.004266664572443,
        0.7057729661435305, 7.793775694725984, 2.516646116210887, -5.015839054895481, 4.437947572121937,
        -0.5000000000000105, 0.0, 0.0, -22.163120567375973, -2.68085106382988, -9.498480243161135,
    ),
    (  # θ^3
        30.538785397362687, 0.0, 0.0, 0.0, 0.0, -71.29643921509799, -105.50412442418646, -17.795762317520953,
        -3.6794962622294873, -60.816583514570766, -25.01371499216569, 48.36759772677378, -45.254838555070954,
        7.714961161769774, 0.0, 0.0, 168.86187098953133, -10.553191489360911, 84.43093549476565,
    ),
    (  # θ^4
        -63.44914351829935, 0.0, 0.0, 0.0, 0.0, 203.8857941474998, 264.56834138391844, 38.560436980711295,
        -6.037449030812929, 207.25216389227566, 95.68935320188315, -181.1051883584333, 174.55919687370587,
        -35.36220871327291, 0.0, 0.0, -490.75481256332586, 92.97872340425266, -300.78520770010255,
    ),
    (  # θ^5
        72.68907639962968, 0.0, 0.0, 0.0, 0.0, -299.89799567134895, -336.5008077199896, -37.31975558934871,
        29.52944208035044, -348.98018560176996, -173.78508632334925, 325.0232651378769, -318.6404248498535,
        70.86930091185476, 0.0, 0.0, 690.2228976697106, -186.12765957446362, 512.9179331307012,
    ),
    (  # θ^6
        -43.19956502078035, 0.0, 0.0, 0.0, 0.0, 220.571491353283, 213.65951078992725, 15.044490869609234,
        -35.07573414676302, 285.1252763278222, 149.0810548062282, -276.7889276043416, 274.1828754382635,
        -65.01182033096983, 0.0, 0.0, -472.8132387706892, 148.9361702127623, -413.71158392435166,
    ),
    (  # θ^7
        10.401407508237059, 0.0, 0.0, 0.0, 0.0, -63.79124456435285, -53.849360791558595, -1.7901659386198678,
        13.797704779497007, -89.71388376756076, -48.330065326297195, 89.28098261426685, -89.03475647916687,
        22.289766970618214, 0.0, 0.0, 126.64640324214908, -42.55319148936055, 126.64640324214848,
    ),
)
# fmt: on

DOPRI8 = MethodTableau(
    name="dopri8",
    order=8,
    tableau=Tableau(a=_A, b=_B, c=_C),
    error=tuple(b - e for b, e in zip(_B, _B7)),
    dense=_DENSE,
    dense_order=7,
    dense_stages=_DENSE_STAGES,
)
