from _typeshed import ReadableBuffer, WriteableBuffer

def to_columns(
    src: ReadableBuffer, dst: WriteableBuffer, at: int, rows: int, width: int, itemsize: int, /
) -> None: ...
