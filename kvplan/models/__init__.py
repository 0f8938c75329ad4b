"""Models that run on kvplan attention backends.

* ``config``  -- `ModelConfig` (from a Hugging Face config or a named random config);
* ``rope``    -- RoPE frequencies (default, linear, llama3) and the rotary table;
* ``llama``   -- the Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3, Mistral);
* ``weights`` -- Hugging Face names -> fused parameters, random init, safetensors / GGUF reads;
* ``loader``  -- where a model comes from (default SmolLM2, folder, GGUF, random).
"""
