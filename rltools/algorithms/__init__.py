"""Advantages and losses: pure tensor functions, no config objects, no torch.distributed."""
