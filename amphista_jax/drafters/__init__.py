"""Draft methods. Each module implements the `Drafter` contract of `base.py`."""

from amphista_jax.drafters.amphista import Amphista
from amphista_jax.drafters.base import DraftContext, Drafter, Proposal, Target
from amphista_jax.drafters.bita import BiTA
from amphista_jax.drafters.eagle import Eagle
from amphista_jax.drafters.gumiho import Gumiho
from amphista_jax.drafters.hydra import Hydra
from amphista_jax.drafters.medusa import Medusa
from amphista_jax.drafters.sar import SemiAutoregressive

DRAFTERS: dict[str, type] = {"amphista": Amphista, "bita": BiTA, "eagle": Eagle, "gumiho": Gumiho, "hydra": Hydra,
                             "medusa": Medusa, "sar": SemiAutoregressive}
# Each method's default settings, and the named variants that are settings of a method (Hydra++).
VARIANTS: dict[str, Drafter] = {"medusa": Medusa(), "amphista": Amphista(), "hydra": Hydra(),
                                "hydra++": Hydra.plus_plus(), "eagle": Eagle(), "gumiho": Gumiho(),
                                "sar": SemiAutoregressive(), "sar-lstm": SemiAutoregressive(encoder="lstm"),
                                "bita": BiTA()}

__all__ = ["DRAFTERS", "VARIANTS", "Amphista", "BiTA", "DraftContext", "Drafter", "Eagle", "Gumiho", "Hydra",
           "Medusa", "Proposal", "SemiAutoregressive", "Target"]
