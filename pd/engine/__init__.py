"""The engine (above ``pd.executor`` and ``pd.parallel``): the step loop. The
continuous-batching ``Scheduler`` and its slot budget and drafter, ``EngineCore`` (runner + pool
+ cache + scheduler with one ``step()``) and its stats, owned by every node and by the colocated
``Engine`` / ``AsyncEngine``, and ``TorchThread``."""
