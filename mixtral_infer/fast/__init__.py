"""Kernels that several fast paths share: oneDNN's packed layout (``cpu_packed``), long rows in
column blocks (``cpu_column_blocks``), compiled few-row reductions (``cpu_reductions``), prompts
widened to float32 or sent to oneDNN (``cpu_upcast``, ``cpu_float32``), attention on CPU and CUDA
(``batched_attention``, ``cuda_attention``, ``varlen_attention``, ``cache_gather``) and the Triton
expert kernels (``triton_experts``). Each equals the readable path it replaces (tests run on CPU)."""
