"""jupyter package."""
