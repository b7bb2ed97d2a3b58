"""Tensor parallel (above ``pd.executor``): a node of N ranks. The group and its collectives
(``group``), the plan rank 0 sends each step (``plan``), the ranks' processes and the runner's
link to them (``ranks``), the KV copies between ranks (``rank_kv``), and a rank's entry point
(``main``), the only module that builds a runner."""
