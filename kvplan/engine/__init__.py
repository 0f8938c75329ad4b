"""The engine: scheduler -> step description -> attention families -> model -> sampler.

* ``config``       -- `EngineConfig`: every engine setting, default and check in one place;
* ``llm``          -- `LLM` (generate, streaming, add_request/step/abort) and `RequestOutput`;
* ``builder``      -- assembles model, KV cache manager and tensors, families, scheduler;
* ``request``      -- `Request`: one request's tokens and state;
* ``scheduler``    -- continuous batching, chunked prefill, prefix reuse, preemption;
* ``step``         -- `StepBatch`: the scheduler's frozen description of one step;
* ``families``     -- `AttentionFamily`: a step -> the metadata of the layers it serves;
* ``runner``       -- a step's model inputs, each family's plan, the model call;
* ``core``         -- one step: schedule, run, sample, update (stop rules, speculative accept);
* ``async_steps``  -- greedy decode steps launched one step ahead;
* ``host_tokens``  -- sampled tokens' device -> host copies;
* ``sampling``     -- `SamplingParams` and the sampler (greedy / temperature / top-k / top-p,
  penalties and logit bias);
* ``speculative``  -- prompt-lookup (n-gram) drafts and their verification;
* ``cuda_graphs``  -- decode steps captured per batch-size bucket;
* ``scoring``      -- teacher-forced logits through the cache (KV format comparisons);
* ``cli_generate`` / ``cli_bench`` -- ``kvplan generate`` and ``kvplan bench``.

One step: `core.EngineCore.step` -> `scheduler.Scheduler.schedule` (a `step.StepBatch`) ->
`runner.ModelRunner.execute` (`families.PagedFamily.plan` drives the backend's
`AttentionMetadata`) -> the model's layers -> the backend's ``forward`` (store + attend).
"""
