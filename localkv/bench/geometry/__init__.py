"""The cache benchmarked at the KV geometry of real models (``benchmarks/geometry.py``).

- ``shapes``: the geometries (Llama 3.1 8B, Gemma 3 12B, Granite 4.0-H-Tiny) and
  what storing their rows once costs;
- ``tokenizer``: a real model's tokenizer keys, read from its GGUF;
- ``models``: random-weight GGUFs with those geometries on a narrow stream;
- ``counters``: /proc/self/io and time inside a method;
- ``measure``: one model at one length, through ``Runtime``;
- ``report``: the ratios, the JSON and the markdown table;
- ``chain``: a stored chain of random rows with real probes, made without the prefill;
- ``floors``: the page cache dropped, a sequential read, a copy;
- ``synthetic``: the restore of such a chain, warm and dropped, against the floors;
- ``synthetic_page``: its section of the page and key of the JSON;
- ``run``: every geometry and length, and the command line.
"""
