from collections.abc import Sequence

from _typeshed import ReadableBuffer, WriteableBuffer

def decode6(
    items: Sequence[
        tuple[ReadableBuffer, ReadableBuffer, ReadableBuffer, Sequence[WriteableBuffer]]
    ],
    simd: bool = True,
    /,
) -> None: ...
def avx2() -> bool: ...
