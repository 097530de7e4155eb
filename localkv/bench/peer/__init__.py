"""localkv beside llama.cpp's own server (llama-server), in one run: the peer page.

- ``servers``: the two servers as processes, from one setting (model, context, threads);
- ``client``: a streamed chat completion as the client sees it, and the JSON posts;
- ``documents``: the requests: a document of N tokens as the system prompt, a question;
- ``plan``: what a run is given (the setting, llama-server, the bounds);
- ``cold``: cold prefill and decode, each server started afresh;
- ``restart``: the first token after a restart, localkv's cache against the slot file;
- ``alternate``: two documents in turn in one running server;
- ``figures``: the medians, the ratios localkv / llama-server and the targets;
- ``report``: the markdown page;
- ``run``: the driver (``python -m localkv.bench.peer``).
"""
