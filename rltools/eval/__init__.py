"""Evaluation: avg@k / pass@k over held-out problems."""
