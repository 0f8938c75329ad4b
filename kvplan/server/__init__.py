"""``kvplan serve``: an OpenAI-compatible HTTP server on the kvplan engine.

* `kvplan.server.protocol`: request bodies -> token ids + `SamplingParams`, the OpenAI error
  shape;
* `kvplan.server.engine_loop`: one background thread drives `LLM.step` for every connection
  (continuous batching) and hands each request's new tokens to its asyncio queue;
* `kvplan.server.metrics`: Prometheus counters, gauges and latency histograms;
* `kvplan.server.app`: the FastAPI application (``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions``, ``/health``, ``/metrics``);
* `kvplan.server.cli_serve`: the ``kvplan serve`` command.
"""
