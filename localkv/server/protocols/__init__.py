"""The HTTP APIs the server speaks, each a package that reads its own JSON into the
neutral requests (``server.requests``) and encodes the answers in its own shapes,
on the one gateway (``server.gateway``). No protocol imports another."""
