from collections.abc import Sequence

from _typeshed import ReadableBuffer, WriteableBuffer

def join(
    hi: ReadableBuffer, items: Sequence[tuple[ReadableBuffer, WriteableBuffer]], /
) -> None: ...
