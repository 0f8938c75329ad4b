"""DeepSeek-V4 on kvplan's hybrid attention family.

* ``config``     -- `DeepseekV4Config` (from a Hugging Face config), `layer_specs()`;
* ``layers``     -- RMSNorms and the interleaved partial RoPE (main / YaRN compress tables);
* ``compressor`` -- CSA / HCA compressors, window pooling, the lightning indexer;
* ``attention``  -- low-rank q, shared K=V head, sinks, grouped output projection;
* ``moe``        -- top-k and hash routers, routed and shared experts;
* ``hyper``      -- hyper-connections (mHC, Sinkhorn) and the hyper head;
* ``model``      -- `DeepseekV4ForCausalLM.forward(input_ids, positions, ctx, logits_indices)`;
* ``weights``    -- `load_deepseek_v4` (a ``save_pretrained`` folder), `init_random`.
"""

from kvplan.models.deepseek_v4.config import DeepseekV4Config, RopeSpec
from kvplan.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kvplan.models.deepseek_v4.weights import cast_model, init_random, load_deepseek_v4

__all__ = [
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "RopeSpec",
    "cast_model",
    "init_random",
    "load_deepseek_v4",
]
