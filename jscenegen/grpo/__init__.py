"""GRPO: advantages, losses, log-probs, optimizer, role masks, train step, rollouts, checkpoints."""
