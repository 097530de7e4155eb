"""Block file formats: what a block file holds and how one is read into buffers.

``blockcodec`` turns a block into the bytes of its file and back, checked
strictly against its index row; ``readinto`` reads one file straight into
the caller's buffers, keeping parsed headers in ``headers``; ``planes`` is
the compact format and ``q6`` its 6-bit code of high bytes, decoded by the
optional compiled module (``compiled``). Nothing here knows the index or
more than one file at a time.
"""
