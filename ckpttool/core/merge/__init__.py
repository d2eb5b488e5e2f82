"""merge."""
