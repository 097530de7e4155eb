"""Saved conversations: the store (``store``), its rows as values (``rows``) and the
migrations that build its schema (``schema``)."""
