"""The two weight layouts, in one place (pure Python: used by torch and JAX code).

"nk": ``[G, N, K]``, Transformers' ``[E, out, in]``; "kn": ``[G, K, N]``.
"""

LAYOUTS = ("nk", "kn")
OTHER_LAYOUT = {"nk": "kn", "kn": "nk"}


def out_features(rhs_shape, rhs_layout: str) -> int:
    """N of weights ``rhs_shape`` laid out as ``rhs_layout``."""
    return rhs_shape[1] if rhs_layout == "nk" else rhs_shape[2]


def in_features(rhs_shape, rhs_layout: str) -> int:
    """K (the contraction dim) of weights ``rhs_shape``."""
    return rhs_shape[2] if rhs_layout == "nk" else rhs_shape[1]


def weight_shape(num_groups: int, k: int, n: int, rhs_layout: str) -> tuple[int, int, int]:
    """Shape of weights (and of their gradient) for ``[., K] -> [., N]``."""
    return (num_groups, n, k) if rhs_layout == "nk" else (num_groups, k, n)
