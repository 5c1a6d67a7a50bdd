"""Print HF transformers' RoPE frequencies for the scaled configs that
src/model/rope_scaling_tests.rs checks touchstone's f32 tables against.

touchstone forms each scaling's frequencies in HF's f32 order of operations
(`RopeScaling::inv_freq_f32`); this script is where the expected bits come
from, so the test's vectors can be regenerated and reviewed:

    python goldens/recorders/rope_scaling_vectors.py > /tmp/vectors.rs

Each case prints the config's `rope_parameters`, the pass length HF is asked
for (`seq_len`, as `dynamic_rope_update` passes it: an int64 tensor) and the
f32 bits of `inv_freq` with HF's `attention_scaling`.
"""
import json
import sys

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

HEAD_DIM = 32
CASES = [
    # name, rope_parameters, max_position_embeddings, seq_len (None: init)
    ("linear", {"rope_type": "linear", "factor": 4.0}, 256, None),
    ("dynamic_short", {"rope_type": "dynamic", "factor": 4.0}, 64, None),
    ("dynamic_70", {"rope_type": "dynamic", "factor": 4.0}, 64, 70),
    ("dynamic_97", {"rope_type": "dynamic", "factor": 2.5}, 64, 97),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256, None),
    ("yarn_untruncated", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "truncate": False, "beta_fast": 16, "beta_slow": 2}, 256, None),
    ("yarn_mscale", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                     "mscale": 0.707, "mscale_all_dim": 1.0}, 512, None),
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, 512, None),
    ("longrope_short", {"rope_type": "longrope", "original_max_position_embeddings": 64,
                        "short_factor": [1.0 + 0.05 * j for j in range(HEAD_DIM // 2)],
                        "long_factor": [1.0 + 0.5 * j for j in range(HEAD_DIM // 2)]}, 256, None),
    ("longrope_long", {"rope_type": "longrope", "original_max_position_embeddings": 64,
                       "short_factor": [1.0 + 0.05 * j for j in range(HEAD_DIM // 2)],
                       "long_factor": [1.0 + 0.5 * j for j in range(HEAD_DIM // 2)]}, 256, 65),
]

for name, params, max_pos, seq_len in CASES:
    params = dict(params, rope_theta=10000.0)
    cfg = LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, head_dim=HEAD_DIM,
                      max_position_embeddings=max_pos, rope_parameters=params)
    fn = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    sl = None if seq_len is None else torch.tensor(seq_len, dtype=torch.int64)
    inv, att = fn(cfg, "cpu", seq_len=sl)
    bits = inv.to(torch.float32).numpy().view("uint32").tolist()
    out = {"name": name, "params": params, "max_position_embeddings": max_pos, "seq_len": seq_len,
           "attention_factor": float(att), "inv_freq_bits": bits}
    sys.stdout.write(json.dumps(out) + "\n")
