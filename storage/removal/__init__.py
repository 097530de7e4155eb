"""Removing blocks: every way a block leaves the store, one module per way.

All of them delete rows first, then files (``deletion``): a crash in
between leaves an orphan file that ``gc`` removes, never a row that points
at nothing. ``quarantine`` moves a bad block aside; ``evict`` brings the
store down to its size, as ``budget`` plans; ``forget`` removes one document
for privacy; ``reconcile`` (``gc``, ``verify``) makes the index and the files
agree again after a crash.
"""
