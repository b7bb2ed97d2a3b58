"""The engine (layer 4, above ``pd.core``, ``pd.model`` and ``pd.cache``): the engine config,
the ``torch`` attention backend, the model runner and sampler, the continuous-batching
``Scheduler``, ``EngineCore`` (runner + pool + cache + scheduler with one ``step()``), owned by
every node and by the colocated ``Engine`` / ``AsyncEngine``, and ``TorchThread``."""
