"""Per-sample step control (``controller="per_sample"``), its own engine: every sample of a batch on its own time,
step size and error ratio. :mod:`.solve` is the entry (:func:`~.solve.odeint_per_sample`, the argument checks and
the refusals the main engine forwards), :mod:`.loop` the batched sweeps of attempted steps, :mod:`.control` the
per-row PI controller, :mod:`.grads` and :mod:`.steps` the replaying gradients through the sweeps (with the step
sizes differentiated or held fixed), :mod:`.adjoint` the continuous adjoint solved per sample."""
