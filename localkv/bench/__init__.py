"""The benchmark room: what ``localkv bench`` measures and how it reports it.

One module per role, from the run down to its tools:

- ``run``: the whole run (every length, the lookup, the notes) and what it ran on;
- ``size``: every measurement of one prompt length, step by step;
- ``baselines``: llama.cpp's state files, ``LlamaDiskCache`` and the floor;
- ``lookup``: the longest-prefix lookup with many blocks indexed;
- ``codecs``: the block encodings written, decoded and timed on one state;
- ``encodings``: the encodings themselves and the buffer layout they decode into;
- ``stats``: how one step is timed (wall time, cold runs, peak memory);
- ``disk``: reads from storage without root (page-cache eviction, ``/proc/self/io``);
- ``text``: the prompt (public-domain prose, cut to exactly N tokens);
- ``results``: the configuration and the results, as values;
- ``table``: each figure as text, and the labelled rows;
- ``report``: the JSON, the markdown page and the chart.

Nothing is imported here: the command line loads this room only for ``localkv bench``.
"""
