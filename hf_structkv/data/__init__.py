"""Package data: per-model head budgets (``head_budgets/<model>/config.json``)."""
