"""The user's side of the GRPO example: a tiny Llama-shaped LM, a verifiable task, a policy."""
