"""The knowledge base (KB) of Algorithm 1: per task a value (the adapter) and a multi-key (the signature),
plus the head's statistics G and e(c). It is the only memory of data that no longer exists.

:mod:`.store` (the commit protocol; its docstring describes the layout on disk), :mod:`.lock` (one writer
at a time), :mod:`.inspect` (``info``, ``check`` and ``problems``), :mod:`.files` (layout, errors,
checksums), and for knowledge bases received from someone else :mod:`.schema` (the manifest's fields and
object paths), :mod:`.tensors` (dtypes, shapes, finite values: the rules the parts declare,
:mod:`proteus.tensor_rules`, gathered for the learner a manifest names) and :mod:`.signing` (an optional
HMAC signature).
"""

from proteus.lazy import exports

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "KBError",
    "KBLockedError",
    "KEY_ENV",
    "KnowledgeBase",
    "READABLE_VERSIONS",
    "Report",
    "check",
    "info",
    "lock_holder",
    "manifest_checksum",
    "object_shapes",
    "problems",
    "read_key_file",
    "write_lock",
]

__getattr__, __dir__ = exports(
    __name__,
    {
        "FORMAT": "files",
        "FORMAT_VERSION": "files",
        "KEY_ENV": "signing",
        "READABLE_VERSIONS": "files",
        "KBError": "files",
        "KBLockedError": "files",
        "KnowledgeBase": "store",
        "Report": "inspect",
        "check": "inspect",
        "info": "inspect",
        "lock_holder": "lock",
        "manifest_checksum": "files",
        "object_shapes": "inspect",
        "problems": "inspect",
        "read_key_file": "signing",
        "write_lock": "lock",
    },
)
