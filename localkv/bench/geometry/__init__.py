"""The cache benchmarked at the KV geometry of real models (``benchmarks/geometry.py``).

- ``shapes``: the geometries (Llama 3.1 8B, Gemma 3 12B, Granite 4.0-H-Tiny) and
  what storing their rows once costs;
- ``tokenizer``: a real model's tokenizer keys, read from its GGUF;
- ``models``: random-weight GGUFs with those geometries on a narrow stream;
- ``counters``: /proc/self/io and time inside a method;
- ``measure``: one model at one length, through ``Runtime``;
- ``report``: the ratios, the JSON and the markdown table;
- ``run``: every geometry and length, and the command line.
"""
