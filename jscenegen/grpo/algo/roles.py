"""Role codes of the per-token role array and the loss mask of the role trained in an update.

An episode's token sequence interleaves environment text (system prompt, observations, tool
results) with the turns of the three policy roles. Every token carries an int8/int32 role code;
an update trains one role (schedule D, D, D, P, C) and only that role's generated tokens.
"""
from __future__ import annotations

import jax.numpy as jnp

ENVIRONMENT = 0
PLANNER = 1
DESIGNER = 2
CRITIC = 3

ROLE_NAMES = {ENVIRONMENT: "environment", PLANNER: "planner", DESIGNER: "designer", CRITIC: "critic"}
ROLE_CODES = {name: code for code, name in ROLE_NAMES.items() if code != ENVIRONMENT}  # policy roles
POLICY_ROLES = (PLANNER, DESIGNER, CRITIC)
_BY_LETTER = {"P": PLANNER, "D": DESIGNER, "C": CRITIC}


def role_from_letter(letter: str) -> int:
    """Role code of a schedule letter ("P", "D" or "C"); raises ValueError for anything else."""
    try:
        return _BY_LETTER[letter]
    except KeyError:
        raise ValueError(f"unknown role letter {letter!r}; expected one of P, D, C") from None


def role_loss_mask(roles, policy_mask, selected):
    """Loss mask of the tokens trained when `selected` is the role of the update.

    Args:
      roles: [B, T] integer role codes (ENVIRONMENT, PLANNER, DESIGNER, CRITIC).
      policy_mask: [B, T] bool/0-1, true on tokens the policy generated (sampled), false on
        prompt, environment text and padding.
      selected: the trained role code (a Python int or a 0-d integer array).

    Returns:
      [B, T] float32 mask, 1.0 where `roles == selected` and the token is a policy token.
      Position 0 of every row is forced to 0 (no token predicts it).

    Raises:
      ValueError: `selected` is a Python int that is not a policy role, or shapes differ.
    """
    if isinstance(selected, int) and selected not in POLICY_ROLES:
        raise ValueError(f"selected role {selected} is not a policy role {POLICY_ROLES}")
    roles = jnp.asarray(roles)
    policy_mask = jnp.asarray(policy_mask)
    if roles.shape != policy_mask.shape or roles.ndim != 2:
        raise ValueError(
            f"roles {roles.shape} and policy_mask {policy_mask.shape} must be the same [B, T]"
        )
    mask = (roles == selected) & (policy_mask != 0)
    mask = mask.at[:, 0].set(False)
    return mask.astype(jnp.float32)
