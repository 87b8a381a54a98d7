"""Data sources: the synthetic copy task (and, later, parallel text)."""
