"""The snapshot store: block files, the SQLite index, eviction and gc."""
