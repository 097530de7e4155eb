from collections.abc import Sequence

from _typeshed import ReadableBuffer, WriteableBuffer

def join(
    hi: ReadableBuffer, items: Sequence[tuple[ReadableBuffer, WriteableBuffer]], /
) -> None: ...
def decode6(
    items: Sequence[
        tuple[ReadableBuffer, ReadableBuffer, ReadableBuffer, Sequence[WriteableBuffer]]
    ],
    simd: bool = True,
    /,
) -> None: ...
def avx2() -> bool: ...
