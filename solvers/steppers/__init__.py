"""The steppers and their tables: how one step of a method is taken. Explicit Runge-Kutta (the library's stepper
:mod:`.fast_rk` with its stage loop, torchdiffeq's ``odeint`` contract, event search, complex states and the Butcher
tableaux with their order conditions), implicit Runge-Kutta (Newton stage solves, predictors, the collocation
tableaux, the sweep to output times and torchdiffeq's fixed grid), the asynchronous leapfrog, compositions and
splittings, Nyström methods for second-order fields and projection onto invariants. The engine
(:mod:`cde_nets.solvers.engine`) picks a stepper; the gradient methods (:mod:`cde_nets.solvers.gradients`) decide
how its steps are differentiated."""
