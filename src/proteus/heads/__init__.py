"""Classification heads: RanPAC's parameter-free ridge/LDA head (Eq. 23, Algorithm 1 lines 8-12)."""

from proteus.lazy import exports

__all__ = ["GAMMA_SELECTIONS", "GammaSelection", "PROTOTYPES", "RanPACHead"]

__getattr__, __dir__ = exports(
    __name__,
    {
        "GAMMA_SELECTIONS": "ranpac",
        "PROTOTYPES": "ranpac",
        "GammaSelection": "ranpac",
        "RanPACHead": "ranpac",
    },
)
