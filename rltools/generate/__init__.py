"""Generation: the vLLM engine wrapper, its weight-sync worker extension, and the generator role loop."""
