"""The device comparison: the same measurements on the CPU build and on a GPU build.

- ``measure``: one build, one process (``python -m localkv.bench.device.measure``): for
  each length, the cold prefill, a verified restore (its time and the bytes it read)
  and the first token after it, with every layer on the device the build offers;
- ``run``: the driver (``python -m localkv.bench.device``): ``measure`` once on the CPU
  build and once on the GPU build (``LLAMA_CPP_LIB_PATH``), then the page;
- ``report``: the markdown page of the two runs, with the ratios device/CPU.
"""
