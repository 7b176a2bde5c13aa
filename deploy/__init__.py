"""deploy package."""
