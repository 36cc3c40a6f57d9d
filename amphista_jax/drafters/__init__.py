"""Draft methods. Each module implements the `Drafter` contract of `base.py`."""

from amphista_jax.drafters.base import DraftContext, Drafter, Proposal
from amphista_jax.drafters.medusa import Medusa

DRAFTERS: dict[str, type] = {"medusa": Medusa}

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "Medusa", "Proposal"]
