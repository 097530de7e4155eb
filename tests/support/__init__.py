"""Helpers the tests share: tiny models, store fixtures, the reliability worker."""
