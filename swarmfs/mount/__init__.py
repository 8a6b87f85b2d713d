"""The read-only FUSE mount of a store (pyfuse3 on trio).

Depends on :mod:`swarmfs.store`; entry points are ``swarmfs mount`` and
``python -m swarmfs.mount._fuse``.
"""

# pyfuse3 and trio are optional (the ``mount`` extra): nothing is imported
# here, so ``python -m swarmfs.mount._fuse`` and the store work without them.
__all__: list[str] = []
