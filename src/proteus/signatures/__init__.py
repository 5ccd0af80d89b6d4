"""Multi-key task signatures and parameter-free retrieval (Section 3: Eq. 2, Eq. 18, Def. 3.3, Thm. 3.5/3.6).

* :mod:`~proteus.signatures.dpgmm`: the variational DP-GMM that learns a task's signature (Eq. 18);
* :mod:`~proteus.signatures.gaussian`: the Gaussian signature patterns and their scores (Eq. 2);
* :mod:`~proteus.signatures.signature`: one task's multi-key signature (Definition 3.1, Eq. 18);
* :mod:`~proteus.signatures.retrieval`: ``(k*, t*) = argmin_{k,t} S_k(x; m_k^t, Lambda_k^t)`` (Section 3.1);
* :mod:`~proteus.signatures.theory`: separation factor and error bounds (Section 3.2, Appendix A).
"""

from proteus.signatures.dpgmm import DPGMM, SignatureFitError
from proteus.signatures.gaussian import GaussianComponents
from proteus.signatures.retrieval import RetrievalResult, retrieve
from proteus.signatures.signature import Signature, fit_signature

__all__ = [
    "DPGMM",
    "GaussianComponents",
    "RetrievalResult",
    "Signature",
    "SignatureFitError",
    "fit_signature",
    "retrieve",
]
