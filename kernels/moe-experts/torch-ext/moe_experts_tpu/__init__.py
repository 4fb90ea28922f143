"""moe-experts-tpu: Transformers mixture-of-experts layers on TPU, through a Pallas grouped matmul.

``register(name="moe_experts_tpu")`` adds ``experts_forward`` to Transformers'
``ALL_EXPERTS_FUNCTIONS`` and returns the name to pass as
``experts_implementation=``. ``experts_forward`` and ``ragged_dot`` are
ragged-dot-tpu's: build/hub.py copies those sources into the subpackage
``_ragged_dot`` at build time (hub_manifests/moe-experts-tpu.toml), and gives
their ``_ops.py`` this build's op namespace (``NAMESPACE``), so this kernel and
ragged-dot-tpu load side by side in one process.
``fused_experts_forward_interpret`` runs the fused program of the TPU path on
CPU in Pallas interpret mode (a correctness check, not fast).
"""

try:  # the shared sources, copied in by the build
    from ._ragged_dot.experts import experts_forward, fused_experts_forward_interpret
except ModuleNotFoundError as e:
    if e.name != f"{__name__}._ragged_dot":
        raise
    raise ImportError(
        f"{__name__}: the shared ragged-dot sources (subpackage `_ragged_dot`) are missing. This "
        "package is assembled by build/hub.py; load a build instead, e.g. `python build/hub.py build "
        "--out dist/hub`, then kernels.get_local_kernel(Path('dist/hub/moe-experts-tpu'))."
    ) from None

from ._ops import NAMESPACE
from ._ragged_dot.ops import ragged_dot
from .registration import DEFAULT_NAME, register

__all__ = [
    "DEFAULT_NAME", "NAMESPACE", "experts_forward", "fused_experts_forward_interpret", "ragged_dot", "register",
]
