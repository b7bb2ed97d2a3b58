"""The endpoints, by family."""
