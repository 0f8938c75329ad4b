"""The engine: scheduler -> KV cache manager -> backend metadata -> model -> sampler.

* ``llm``          -- `LLM` (generate, streaming, add_request/step/abort) and `RequestOutput`;
* ``sampling``     -- `SamplingParams`;
* ``builder``      -- assembles model, KV cache manager and tensors, metadata, scheduler;
* ``scheduler``    -- continuous batching, chunked prefill, prefix reuse, preemption;
* ``core``         -- one step: schedule, run, sample, update (stop rules, speculative accept);
* ``runner``       -- step inputs and metadata fields, model call;
* ``sampler``      -- greedy / temperature / top-k / top-p with per-request seeds;
* ``speculative``  -- prompt-lookup (n-gram) drafts and their verification;
* ``cuda_graphs``  -- decode steps captured per batch-size bucket;
* ``scoring``      -- teacher-forced logits through the cache (KV format comparisons);
* ``cli_generate`` / ``cli_bench`` -- ``kvplan generate`` and ``kvplan bench``.
"""
