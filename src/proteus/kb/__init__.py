"""The knowledge base (KB) of Algorithm 1: per task a value (the adapter) and a multi-key (the signature),
plus the head's statistics G and e(c). It is the only memory of data that no longer exists.

:mod:`.store` (the commit protocol; its docstring describes the layout on disk), :mod:`.lock` (one writer
at a time), :mod:`.inspect` (``info``, ``check`` and ``problems``), :mod:`.files` (layout, errors,
checksums), and for knowledge bases received from someone else :mod:`.schema` (the manifest's fields and
object paths), :mod:`.tensors` (dtypes, shapes, finite values: the rules the parts declare,
:mod:`proteus.tensor_rules`, gathered for the learner a manifest names) and :mod:`.signing` (an optional
HMAC signature).
"""

from proteus.kb.files import (
    FORMAT,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    KBError,
    KBLockedError,
    manifest_checksum,
)
from proteus.kb.inspect import Report, check, info, problems
from proteus.kb.lock import lock_holder, write_lock
from proteus.kb.signing import KEY_ENV, read_key_file
from proteus.kb.store import KnowledgeBase

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "KEY_ENV",
    "READABLE_VERSIONS",
    "KBError",
    "KBLockedError",
    "KnowledgeBase",
    "Report",
    "check",
    "info",
    "lock_holder",
    "manifest_checksum",
    "problems",
    "read_key_file",
    "write_lock",
]
