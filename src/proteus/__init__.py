"""proteus: continual fine-tuning with provably accurate, parameter-free task retrieval.

An implementation of PROTEUS (Le, Bui, Hoang, Hoang; ICLR 2026 submission): adaptive LoRA
composition (Eq. 9, Eq. 15), DP-GMM multi-key signatures (Eq. 18) and RanPAC's LDA head (Eq. 23).
"""

__version__ = "0.1.0"
