"""Per-partition search: multi-pass multi-objective Bayesian optimisation and its baselines."""
