#!/usr/bin/env python3
"""Record golden tensors for every canonical stage with HF transformers.

usage: record_hf.py MODEL_DIR OUT_FILE [--prompt TEXT] [--decode-steps N]

Runs the model in MODEL_DIR (PyTorch, CPU, float32, eager attention, one
thread, deterministic algorithms, no TF32) on the prompt as one prefill pass
followed by N greedy decode steps that reuse the KV cache, and writes every
canonical stage of every step into ONE safetensors file, OUT_FILE.

Keys are `<step>/<stage>` with steps `prefill`, `decode1`, ..., `decodeN`
(the vocabulary of src/stage.rs). Row-major, batch dimension dropped;
T = tokens fed in this step, S = KV positions after this step, H heads,
KV kv heads, D head dim, E hidden, F FFN width, V vocab:

  tokens                 [T]       int64, the ids fed in this step
  positions              [T]       int64, their positions
  embed                  [T,E]     embed_tokens output
  blk.{i}.attn_norm      [T,E]     input_layernorm output
  blk.{i}.q              [T,H,D]   q_proj output (bias included), before RoPE
  blk.{i}.k / .v         [T,KV,D]  k_proj / v_proj outputs, before RoPE
  blk.{i}.q_rope         [T,H,D]   q after RoPE
  blk.{i}.k_rope         [T,KV,D]  k after RoPE (this step's positions only)
  blk.{i}.attn_probs     [H,T,S]   softmax output, masked entries are 0
  blk.{i}.attn_ctx       [T,H*D]   attention context, the input of o_proj
  blk.{i}.attn_out       [T,E]     o_proj output
  blk.{i}.ffn_inp        [T,E]     residual after attention
  blk.{i}.ffn_norm       [T,E]     post_attention_layernorm output
  blk.{i}.ffn_gate / .ffn_up [T,F] gate_proj / up_proj outputs
  blk.{i}.ffn_act        [T,F]     silu(gate) * up, the input of down_proj
  blk.{i}.ffn_out        [T,E]     down_proj output
  blk.{i}.out            [T,E]     residual stream after the block
  output_norm            [T,E]     final norm output
  logits                 [T,V]

`__metadata__` holds `format` = touchstone-golden/1 and `provenance`, a
compact sorted-key JSON string (see build_provenance). The output contains
nothing that varies between runs or machines (no time, host or path), so a
rerun with the pinned packages is byte-for-byte identical.
"""
import argparse
import hashlib
import importlib
import json
import os
import platform
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

# Import the sibling script without leaving a __pycache__ in the repository.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_model import SEEDS  # noqa: E402  (the seeds live with the model builder)
from golden_io import FORMAT, save_deterministic  # noqa: E402  (shared with record_llamacpp.py)

RECORDER = "goldens/recorders/record_hf.py"
DEFAULT_PROMPT = "Golden tensors check every stage."


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def make_deterministic():
    # One thread: a different thread count may change the reduction order
    # inside matmuls and therefore the last bits of every tensor.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # TF32 only matters on a GPU, but pin it off so a CUDA rerun cannot
    # silently record 10-bit-mantissa matmuls.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class Recorder:
    """Forward hooks that copy each stage of the current step into `rec`."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        # The modeling module whose apply_rotary_pos_emb the attention calls:
        # modeling_qwen2 for Qwen2, modeling_llama for Llama.
        self.modeling = importlib.import_module(
            f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
        assert type(model.model.layers[0].self_attn).__module__ == self.modeling.__name__
        self.H, self.KV, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rec = {}
        self.layer = None  # index of the decoder layer currently running
        self.handles = []
        self.orig_rope = None

    def put(self, name, t):
        """Store `t`, which still has its batch dimension of 1. Index it away
        rather than squeeze(): squeeze would also drop T = 1 in decode steps."""
        assert name not in self.rec, f"stage {name} recorded twice in one step"
        assert t.shape[0] == 1, f"{name}: expected batch 1, got shape {tuple(t.shape)}"
        # Copy so that later in-place ops in the model cannot alias the record.
        self.rec[name] = t[0].detach().to(torch.float32).contiguous().numpy().copy()

    def install(self):
        m = self.model.model
        H, KV, D = self.H, self.KV, self.D
        fwd = lambda mod, fn: self.handles.append(mod.register_forward_hook(fn))
        pre = lambda mod, fn: self.handles.append(mod.register_forward_pre_hook(fn))

        fwd(m.embed_tokens, lambda mod, i, o: self.put("embed", o))
        for li, layer in enumerate(m.layers):
            p = f"blk.{li}."

            def enter(mod, i, li=li):
                self.layer = li
            pre(layer, enter)
            fwd(layer.input_layernorm, lambda mod, i, o, p=p: self.put(p + "attn_norm", o))
            a = layer.self_attn
            # [1,T,H*D] -> [1,T,H,D]: the canonical per-head layout.
            fwd(a.q_proj, lambda mod, i, o, p=p: self.put(p + "q", o.view(1, o.shape[1], H, D)))
            fwd(a.k_proj, lambda mod, i, o, p=p: self.put(p + "k", o.view(1, o.shape[1], KV, D)))
            fwd(a.v_proj, lambda mod, i, o, p=p: self.put(p + "v", o.view(1, o.shape[1], KV, D)))
            pre(a.o_proj, lambda mod, i, p=p: self.put(p + "attn_ctx", i[0]))
            fwd(a.o_proj, lambda mod, i, o, p=p: self.put(p + "attn_out", o))
            # The residual after attention is not a module output; it is the
            # input of post_attention_layernorm.
            pre(layer.post_attention_layernorm, lambda mod, i, p=p: self.put(p + "ffn_inp", i[0]))
            fwd(layer.post_attention_layernorm, lambda mod, i, o, p=p: self.put(p + "ffn_norm", o))
            mlp = layer.mlp
            fwd(mlp.gate_proj, lambda mod, i, o, p=p: self.put(p + "ffn_gate", o))
            fwd(mlp.up_proj, lambda mod, i, o, p=p: self.put(p + "ffn_up", o))
            # silu(gate)*up is an inline product, observable only as the
            # input of down_proj.
            pre(mlp.down_proj, lambda mod, i, p=p: self.put(p + "ffn_act", i[0]))
            fwd(mlp.down_proj, lambda mod, i, o, p=p: self.put(p + "ffn_out", o))
            # transformers 5 decoder layers return a tensor; 4.x returned a tuple.
            fwd(layer, lambda mod, i, o, p=p: self.put(p + "out", o[0] if isinstance(o, tuple) else o))
        fwd(m.norm, lambda mod, i, o: self.put("output_norm", o))
        fwd(self.model.lm_head, lambda mod, i, o: self.put("logits", o))

        # RoPE is a plain function, not a module, so no hook can see it.
        # Qwen2Attention.forward (LlamaAttention.forward) looks up the
        # module-level name at call time, so wrapping that name captures q/k
        # after rotation.
        self.orig_rope = self.modeling.apply_rotary_pos_emb
        orig = self.orig_rope

        def rope_wrapper(q, k, cos, sin, *args, **kwargs):
            qe, ke = orig(q, k, cos, sin, *args, **kwargs)
            p = f"blk.{self.layer}."
            # HF layout [1,H,T,D] -> canonical [T,H,D] (batch dropped by put).
            self.put(p + "q_rope", qe.transpose(1, 2))
            self.put(p + "k_rope", ke.transpose(1, 2))
            return qe, ke
        self.modeling.apply_rotary_pos_emb = rope_wrapper

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.orig_rope is not None:
            self.modeling.apply_rotary_pos_emb = self.orig_rope
            self.orig_rope = None


def expected_stages(n_layers):
    """The canonical stages of one step, as in src/stage.rs."""
    block = ["attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_probs", "attn_ctx",
             "attn_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_act", "ffn_out", "out"]
    names = ["embed"]
    for li in range(n_layers):
        names += [f"blk.{li}.{s}" for s in block]
    return names + ["output_norm", "logits", "tokens", "positions"]


def expected_shape(stage, T, S, cfg):
    """The canonical layout of `stage` (see the module docstring)."""
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    name = stage.split(".")[-1]
    return {
        "tokens": (T,), "positions": (T,), "logits": (T, V),
        "q": (T, H, D), "q_rope": (T, H, D), "k": (T, KV, D), "k_rope": (T, KV, D),
        "v": (T, KV, D), "attn_probs": (H, T, S), "attn_ctx": (T, H * D),
        "ffn_gate": (T, F), "ffn_up": (T, F), "ffn_act": (T, F),
    }.get(name, (T, E))  # embed, norms, attn_out, ffn_inp, ffn_out, out


def attention_rows(probs, positions):
    """Per-row non-uniformity of one layer's softmax output probs [H,T,S]
    (row t sees positions[t]+1 keys). Returns, for every row that sees at
    least 2 keys (a 1-key row is trivially one-hot): its max probability,
    that max divided by the uniform value 1/n_keys, and its entropy divided
    by log(n_keys) (1 = uniform, 0 = one-hot)."""
    out = []
    for t, p in enumerate(positions):
        n = int(p) + 1
        if n < 2:
            continue
        rows = probs[:, t, :n].astype(np.float64)  # [H,n]; masked keys dropped
        ent = -(rows * np.log(np.clip(rows, 1e-300, 1.0))).sum(-1) / np.log(n)
        for h in range(rows.shape[0]):
            m = rows[h].max()
            out.append((m, m * n, ent[h]))
    return out


def attention_summary(rows):
    a = np.array(rows)
    return {
        "rows": len(a),
        "mean_row_max": round(float(a[:, 0].mean()), 4),
        "row_max_x_uniform_mean": round(float(a[:, 1].mean()), 2),
        "row_max_x_uniform_median": round(float(np.median(a[:, 1])), 2),
        "normalized_entropy_mean": round(float(a[:, 2].mean()), 3),
        "rows_max_above_0.9": int((a[:, 0] > 0.9).sum()),
    }


def build_provenance(args, cfg_dict, prompt_ids, greedy_ids, steps, cache_vs_full):
    return {
        "source": "hf",
        "recorder": RECORDER,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "prompt": {"text": args.prompt, "token_ids": prompt_ids},
        "greedy_ids": greedy_ids,
        "decode_steps": args.decode_steps,
        "steps": steps,
        "model_config": cfg_dict,
        "seeds": SEEDS,
        "model_sha256": sha256(os.path.join(args.model_dir, "model.safetensors")),
        "tokenizer_sha256": sha256(os.path.join(args.model_dir, "tokenizer.json")),
        "attn_implementation": "eager",
        "dtype": "float32",
        "tf32": False,
        "torch_threads": torch.get_num_threads(),
        "cache_vs_full_max_abs_diff": cache_vs_full,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("out_file")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--decode-steps", type=int, default=3)
    args = ap.parse_args()
    if args.decode_steps < 0:
        ap.error("--decode-steps must be >= 0")

    make_deterministic()
    transformers.utils.logging.disable_progress_bar()

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg = model.config
    assert model.model.layers[0].self_attn.config._attn_implementation == "eager"

    prompt_ids = tok(args.prompt, add_special_tokens=True)["input_ids"]
    # The committed tokenizer.json is what engines read; make sure the
    # transformers wrapper did not tokenize differently from it.
    raw = tokenizers.Tokenizer.from_file(os.path.join(args.model_dir, "tokenizer.json"))
    assert raw.encode(args.prompt).ids == prompt_ids, "AutoTokenizer and tokenizer.json disagree"
    assert len(prompt_ids) >= 2, "prompt must have at least 2 tokens"

    r = Recorder(model)
    r.install()
    out = {}
    steps, greedy_ids = [], []
    x = torch.tensor([prompt_ids], dtype=torch.int64)
    past, pos = None, 0
    att_rows = {"prefill": [], "decode": []}
    logit_absmax = 0.0
    try:
        with torch.no_grad():
            for si in range(args.decode_steps + 1):
                step = "prefill" if si == 0 else f"decode{si}"
                steps.append(step)
                r.rec.clear()
                T = x.shape[1]
                positions = torch.arange(pos, pos + T, dtype=torch.int64)
                res = model(input_ids=x, position_ids=positions[None], past_key_values=past,
                            use_cache=True, output_attentions=True, return_dict=True)
                past = res.past_key_values
                assert len(res.attentions) == cfg.num_hidden_layers
                for li, a in enumerate(res.attentions):
                    r.put(f"blk.{li}.attn_probs", a)  # [1,H,T,S] -> [H,T,S]
                    att_rows["prefill" if si == 0 else "decode"] += attention_rows(
                        r.rec[f"blk.{li}.attn_probs"], positions.numpy())
                # The hooked logits must be what the model returned.
                assert np.array_equal(r.rec["logits"], res.logits[0].numpy())
                r.rec["tokens"] = x[0].numpy().astype(np.int64)
                r.rec["positions"] = positions.numpy()
                assert sorted(r.rec) == sorted(expected_stages(cfg.num_hidden_layers)), \
                    sorted(set(r.rec) ^ set(expected_stages(cfg.num_hidden_layers)))
                S = pos + T
                for k, v in r.rec.items():
                    assert v.shape == expected_shape(k, T, S, cfg), f"{step}/{k}: shape {v.shape}"
                    if v.dtype != np.int64:
                        assert np.isfinite(v).all(), f"{step}/{k} is not finite"
                    out[f"{step}/{k}"] = v
                logit_absmax = max(logit_absmax, float(np.abs(r.rec["logits"]).max()))
                pos += T
                nxt = int(res.logits[0, -1].argmax())
                greedy_ids.append(nxt)
                x = torch.tensor([[nxt]], dtype=torch.int64)
    finally:
        r.remove()

    # KV-cache cross-check: one forward over prompt + every token fed so far
    # must give (nearly) the same last-row logits as the cached last step.
    with torch.no_grad():
        full = torch.tensor([prompt_ids + greedy_ids[:-1]], dtype=torch.int64)
        lf = model(input_ids=full).logits[0, -1].numpy()
    cache_vs_full = float(np.abs(lf - out[f"{steps[-1]}/logits"][-1]).max())

    # The config exactly as HF saved it next to the weights.
    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg_dict = json.load(f)
    prov = build_provenance(args, cfg_dict, prompt_ids, greedy_ids, steps, cache_vs_full)
    metadata = {
        "format": FORMAT,
        "provenance": json.dumps(prov, sort_keys=True, separators=(",", ":")),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out_file)), exist_ok=True)
    # Write to a temporary name and rename, so a failed run never leaves a
    # half-written golden file behind.
    tmp = args.out_file + ".tmp"
    save_deterministic(out, metadata, tmp)
    os.replace(tmp, args.out_file)

    # The simple figure: mean row max of the prefill probabilities
    # vs the uniform 1/S (S = prompt length). It flatters: causal row t sees
    # only t+1 keys, so even perfectly uniform rows score well above 1/S.
    # The per-row figures (each row against its own 1/n_keys) are the honest
    # measure and what INITIALIZER_RANGE in make_model.py was chosen on.
    S0 = len(prompt_ids)
    pre_mean_max = float(np.mean([out[f"prefill/blk.{li}.attn_probs"].max(axis=-1).mean()
                                  for li in range(cfg.num_hidden_layers)]))
    print(json.dumps({
        "out": args.out_file,
        "tensors": len(out),
        "bytes": os.path.getsize(args.out_file),
        "sha256": sha256(args.out_file),
        "prompt_ids": prompt_ids,
        "greedy_ids": greedy_ids,
        "cache_vs_full_max_abs_diff": cache_vs_full,
        "logits_absmax": round(logit_absmax, 4),
        "attention": {
            "prefill_mean_row_max": round(pre_mean_max, 4),
            "prefill_uniform_1_over_S": round(1.0 / S0, 4),
            "prefill_mean_row_max_x_1_over_S": round(pre_mean_max * S0, 2),
            "prefill_rows": attention_summary(att_rows["prefill"]),
            "decode_rows": attention_summary(att_rows["decode"]) if att_rows["decode"] else None,
        },
    }))


if __name__ == "__main__":
    sys.exit(main())
