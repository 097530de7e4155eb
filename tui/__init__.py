"""The Textual chat app; it talks only to the runtime API."""
