"""Draft methods. Each module implements the `Drafter` contract of `base.py`."""

from amphista_jax.drafters.amphista import Amphista
from amphista_jax.drafters.base import DraftContext, Drafter, Proposal, Target
from amphista_jax.drafters.hydra import Hydra
from amphista_jax.drafters.medusa import Medusa

DRAFTERS: dict[str, type] = {"amphista": Amphista, "hydra": Hydra, "medusa": Medusa}

__all__ = ["DRAFTERS", "Amphista", "DraftContext", "Drafter", "Hydra", "Medusa", "Proposal", "Target"]
