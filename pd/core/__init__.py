"""The bottom layer: what every part of pd shares, importing nothing above it.

``request`` (a request and its status), ``sampling_params``, ``batch`` (the flat token layout of
one forward) and ``attention`` (the interface every attention backend implements), ``kv_pool``
(the slot allocator and the per-layer K/V tensors), ``outputs`` (what an engine hands back, and
the interface the HTTP server drives), ``messages`` (the wire messages of the control plane),
``envs`` (the one module that reads environment variables) and ``options`` (config fields with
CLI help). See ``tests/test_layers.py`` for the layer order.
"""
