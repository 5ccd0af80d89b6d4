"""Classification heads: RanPAC's parameter-free ridge/LDA head (Eq. 23, Algorithm 1 lines 8-12)."""

from proteus.heads.ranpac import GAMMA_SELECTIONS, PROTOTYPES, GammaSelection, RanPACHead

__all__ = ["GAMMA_SELECTIONS", "PROTOTYPES", "GammaSelection", "RanPACHead"]
