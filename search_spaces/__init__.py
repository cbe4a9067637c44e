"""Which layouts exist for a model x cluster x workload: legality rules with their reasons (layout),
the same as columns of arrays (columns), what each runner can run (runnable), the Optuna space (space)."""
