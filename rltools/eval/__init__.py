"""Evaluation: avg@k / pass@k over held-out problems, during training and of exported policies (`rltools eval`)."""
