"""Lagged rollouts (k = 2, TIS) against k = 0: GRPO's held-out accuracy on SmolLM2-135M-Instruct (README.md)."""
