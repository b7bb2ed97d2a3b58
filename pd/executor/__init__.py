"""The executor (above ``pd.core``, ``pd.model`` and ``pd.cache``): the engine config and what
runs a batch's forward and samples from it. ``ModelRunner`` (the model, its KV pool, attention
backend and compiled decode graphs), attention and its C++ kernel, the sampler with penalties,
grammar masks and speculative verification, and the host tier's pool."""
