"""GRPO and forking tokens on SmolLM2-135M-Instruct (preregistration.md): does GRPO improve a real model, does
anything collapse, and does MEI move before it does."""
