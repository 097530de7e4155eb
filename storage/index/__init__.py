"""The SQLite index: its connection and queries, its rows as values, its schema.

``blockindex`` owns the connection and every query (it knows rows, never
files); ``rows`` turns result rows into ``BlockRow`` and ``SnapshotRow``;
``migrations`` holds the schema as an ordered list of migrations, and the
registry other databases of localkv use for theirs.
"""
