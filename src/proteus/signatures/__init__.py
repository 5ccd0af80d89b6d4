"""Multi-key task signatures and parameter-free retrieval (Section 3: Eq. 2, Eq. 18, Def. 3.3, Thm. 3.5/3.6).

* :mod:`~proteus.signatures.dpgmm`: the variational DP-GMM that learns a task's signature (Eq. 18), with
  :mod:`~proteus.signatures.posterior` (the fitted posterior and its queries),
  :mod:`~proteus.signatures.woodbury` (its Mahalanobis factors), :mod:`~proteus.signatures.kmeans` (its
  initialisation and the K-means ablation) and :mod:`~proteus.signatures.errors`;
* :mod:`~proteus.signatures.gaussian`: the Gaussian signature patterns and their scores (Eq. 2), one class
  per covariance kind (registry ``COVARIANCES``): :mod:`~proteus.signatures.components` (their base),
  :mod:`~proteus.signatures.dense` (``"full"``, ``"ppca"``) and :mod:`~proteus.signatures.shared` (the
  shared-plus-low-rank storage);
* :mod:`~proteus.signatures.fitting`: the task covariance (``PRIORS``, ``PRIOR_SCALES``) and the
  clusterings (``METHODS``);
* :mod:`~proteus.signatures.signature`: one task's multi-key signature (Definition 3.1, Eq. 18);
* :mod:`~proteus.signatures.retrieval`: ``(k*, t*) = argmin_{k,t} S_k(x; m_k^t, Lambda_k^t)`` (Section 3.1);
* :mod:`~proteus.signatures.theory`: separation factor and error bounds (Section 3.2, Appendix A).
"""

from proteus.lazy import exports

__all__ = [
    "DPGMM",
    "GaussianComponents",
    "RetrievalResult",
    "Signature",
    "SignatureFitError",
    "fit_clusters",
    "fit_signature",
    "retrieve",
    "signature_from_fit",
]

__getattr__, __dir__ = exports(
    __name__,
    {
        "DPGMM": "dpgmm",
        "GaussianComponents": "gaussian",
        "RetrievalResult": "retrieval",
        "Signature": "signature",
        "SignatureFitError": "dpgmm",
        "fit_clusters": "signature",
        "fit_signature": "signature",
        "retrieve": "retrieval",
        "signature_from_fit": "signature",
    },
)
