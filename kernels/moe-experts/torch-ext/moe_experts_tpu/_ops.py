"""Op namespace of this build.

The Hub build rewrites this file with a namespace derived from the content
hash of the kernel sources, so two builds (say v1 and v2) can be loaded into
one process without their torch.library registrations colliding.
"""

NAMESPACE = "_moe_experts_tpu_dev"


def op_name(name: str) -> str:
    """Fully qualified torch.library name of op `name` in this build."""
    return f"{NAMESPACE}::{name}"
