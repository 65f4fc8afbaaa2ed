"""The in-process engine."""
