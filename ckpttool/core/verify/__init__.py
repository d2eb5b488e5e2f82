"""verify: the operation, its one data pass, --against, manifests and the list of problem
codes."""
