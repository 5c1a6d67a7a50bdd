#!/usr/bin/env python3
"""HF transformers as an engine under test: touchstone's subprocess protocol,
version 1, served on stdin/stdout (`touchstone run SPEC --engine hf`).

usage: engine_hf.py [--threads N] [--attn-scale X]

It runs the model as record_hf.py records the `hf` goldens (hf_model.load),
and taps it with the recorders' own hooks (hf_hooks.Recorder: forward hooks
on every module, the module-level apply_rotary_pos_emb and
eager_attention_forward wrapped), so its captures are exactly the stages the
goldens name:

- load: an HF folder (config.json + safetensors) or a `.gguf` file, which
  transformers' GGUF loader dequantises to float32 (gguf-py), tokenizer and
  config from the file; PyTorch on the CPU, eager attention, one thread
  (--threads), deterministic algorithms, every parameter copied to a fresh
  aligned allocation (record_hf.py's reason: the goldens depend on the
  weights only). `storage` f32 runs float32; bf16 and f16 cast the weights
  after loading, as record_hf.py --dtype bfloat16/float16 does, HF's float32
  islands kept (RMSNorm, softmax, RoPE tables). The load answer declares the
  arithmetic (the storage: sums in f32, nothing quantised), every stage as
  tappable (eager attention materialises scores and probabilities) and
  `"tokenize": true`.
- run: one prefill over the prompt, then one token per decode step through
  HF's KV cache (a plain DynamicCache for sliding-window models, as
  record_hf.py, so every position stays in the cache); the logits of every
  prefill row when tapped. Greedy picks argmax (lowest index of a tie).
  Random sampling uses HF's own logits processors in generate()'s order
  (temperature, top-k, top-p; built by GenerationMixin._get_logits_processor
  as record_hf.py --sample-probs does), softmax, and torch.multinomial with a
  torch.Generator seeded with the request's seed: one seed gives the same
  tokens every run, another seed other tokens. `sample_probs` is that
  distribution. Forced tokens (teacher forcing) are fed instead of the
  sampled ones; the sampled ones are reported.
- tokenize: the model's HF tokenizer (add_special_tokens; with chat, its chat
  template as one user message with the generation prompt, then tokenised
  without added specials: the template writes any BOS).

Hooks only observe: a stage that is not tapped is not copied, and the
forward is the same whatever is tapped (the `tap_invariance` check).

--attn-scale X plants a bug for tests: every attention module's `scaling`
(1/sqrt(head_dim) in HF) is set to X, so the attention scores are scaled
wrongly from the first layer on; touchstone's first divergence is
prefill/blk.0.attn_scores. The engine then calls itself
`hf-transformers+attn-scale=X`.

Log lines go to stderr; stdout carries protocol responses only.
"""
import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_protocol import Engine, EngineError, logger, serve  # noqa: E402

NAME = "hf-transformers"
STORAGE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


class HfEngine(Engine):
    name = NAME

    def __init__(self, log, attn_scale=None):
        super().__init__(log)
        self.attn_scale = attn_scale
        if attn_scale is not None:
            self.name = f"{NAME}+attn-scale={attn_scale:g}"

    def load_model(self, path, storage):
        import torch
        import transformers
        import golden_io
        import hf_hooks
        import hf_model

        if storage not in STORAGE:
            raise EngineError(f"unsupported storage {storage!r}: this engine runs f32, bf16 and f16 "
                              "(record_hf.py's dtypes)")
        if os.path.isfile(path):
            if not path.endswith(".gguf"):
                raise EngineError(f"{path} is a file but not a .gguf; give an HF model folder or a .gguf file")
            how = "dequantised to float32 by transformers' GGUF loader"
        else:
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise EngineError(f"{path} has no config.json (an HF model folder needs one; for a GGUF give "
                                  "the .gguf file)")
            how = "safetensors"
        if getattr(self, "rec", None) is not None:
            self.rec.remove()  # a second load: unhook the first model
            self.rec = None
        # As record_hf.py: eager float32, fresh 64-byte aligned parameters (the
        # numbers do not depend on where the file put each tensor), then cast
        # to the storage; no hashing, no progress lines.
        m = hf_model.load(path, None, STORAGE[storage], None)
        self.tok, model, cfg = m.tok, m.model, m.cfg
        if self.attn_scale is not None:
            for layer in model.model.layers:
                layer.self_attn.scaling = self.attn_scale
            self.log(f"PLANTED BUG: every attention module's scaling is {self.attn_scale:g} "
                     f"(HF's is head_dim^-0.5)")
        self.model, self.cfg, self.torch = model, cfg, torch
        n = cfg.num_hidden_layers
        self.vocab = cfg.vocab_size
        # (a mixture-of-experts model: its routed layers' ffn_moe_* stages, moe_hooks.py)
        self.known_stages = set(golden_io.all_stages(cfg.model_type, n, ["sample_probs"], golden_io.moe_layout(cfg)))
        # Stages another architecture has (q_norm, post norms): skipped.
        self.absent_stages = set(golden_io.all_stages("gemma3_text", n)) - self.known_stages
        self.sliding = any(w is not None for w in hf_hooks.layer_windows(cfg))
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        self.rec = TapRecorder(model)
        # The recorders' per-layer progress lines would flood the log.
        self.rec.log = lambda msg: None
        self.rec.install()
        self.log(f"{cfg.model_type}, {n} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {how}, "
                 f"storage {storage}; torch {torch.__version__}, transformers {transformers.__version__}, "
                 f"{torch.get_num_threads()} thread(s)")
        return {"arithmetic": storage, "tokenize": True}

    def run_checked(self, r):
        torch = self.torch
        from transformers import DynamicCache
        model, rec = self.model, self.rec
        want = set(r.taps) - {"sample_probs"}
        if self.qk_norm:
            # The q_norm/k_norm hooks find the norm's layout by
            # comparing its input with the stored projection, tapped or not:
            # q and k are always kept (then dropped if not tapped).
            want |= {f"blk.{li}.{w}" for li in range(self.cfg.num_hidden_layers) for w in ("q", "k")}
        rec.want = want
        sampler = Sampler(model, r.sampling, r.seed, torch)
        tensors, tokens = {}, []
        past = DynamicCache() if self.sliding else None
        x = list(r.prompt)
        fed = list(r.prompt)
        pos = 0
        with torch.no_grad():
            for si in range(r.decode_steps + 1):
                step = "prefill" if si == 0 else f"decode{si}"
                rec.rec.clear()
                rec.step = step
                T = len(x)
                positions = torch.arange(pos, pos + T, dtype=torch.int64)
                rec.S = pos + T
                res = model(input_ids=torch.tensor([x], dtype=torch.int64), position_ids=positions[None],
                            past_key_values=past, use_cache=True, output_attentions=True, return_dict=True)
                past = res.past_key_values
                for li, a in enumerate(res.attentions):
                    rec.put(f"blk.{li}.attn_probs", a)
                last = res.logits[0, -1]
                tok, probs = sampler(last, fed)
                if probs is not None and "sample_probs" in r.taps:
                    tensors[f"{step}/sample_probs"] = probs.to(torch.float32).numpy()[None].copy()
                for k, v in rec.rec.items():
                    if k in r.taps:
                        tensors[f"{step}/{k}"] = v
                tokens.append(tok)
                pos += T
                if si < r.decode_steps:
                    x = [r.feed(si, tok)]
                    fed += x
        rec.rec.clear()
        return tensors, tokens

    def tokenize(self, text, chat):
        if not chat:
            return self.tok(text, add_special_tokens=True)["input_ids"]
        if not getattr(self.tok, "chat_template", None):
            raise EngineError("the model's tokenizer has no chat template")
        rendered = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
        return self.tok(rendered, add_special_tokens=False)["input_ids"]


def TapRecorder(model):
    """hf_hooks.Recorder copying only the stages in `want` (None: all)."""
    import hf_hooks

    class Tap(hf_hooks.Recorder):
        want = None

        def put(self, name, t):
            if self.want is None or name in self.want:
                super().put(name, t)
    return Tap(model)


class Sampler:
    """Greedy: argmax of the last logits row (torch: the first maximal
    index). Random: HF's processors, softmax, torch.multinomial on a seeded
    generator (see the module docstring)."""

    def __init__(self, model, sampling, seed, torch):
        self.torch = torch
        self.sampling = sampling
        if sampling is None:
            return
        from transformers import GenerationConfig
        gc = GenerationConfig(do_sample=True, temperature=sampling["temperature"], top_k=sampling["top_k"] or 0,
                              top_p=1.0 if sampling["top_p"] is None else sampling["top_p"])
        self.procs = model._get_logits_processor(generation_config=gc, input_ids_seq_length=1, device="cpu")
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, last, fed):
        """(token, distribution [V] or None for greedy)."""
        torch = self.torch
        if self.sampling is None:
            return int(last.argmax()), None
        scores = self.procs(torch.tensor([fed], dtype=torch.int64), last[None])
        probs = torch.nn.functional.softmax(scores, dim=-1)
        tok = int(torch.multinomial(probs, num_samples=1, generator=self.gen)[0, 0])
        return tok, probs[0]


def main():
    ap = argparse.ArgumentParser(description="HF transformers as a touchstone engine under test (subprocess "
                                             "protocol 1: JSON lines on stdin/stdout; see the module docstring)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: deterministic, as the goldens)")
    ap.add_argument("--attn-scale", type=float, default=None, metavar="X",
                    help="PLANTED BUG for tests: use X as every layer's attention scale instead of 1/sqrt(head_dim)")
    args = ap.parse_args()
    log = logger(NAME)
    try:
        import torch  # noqa: F401
        import hf_model
    except ImportError as e:
        log(f"cannot import the recorders' packages ({e}): run it with the recorders' venv, created by "
            "`touchstone goldens regen` or goldens/recorders/regen.sh ($TOUCHSTONE_CACHE/recorders-venv)")
        return 2
    hf_model.make_deterministic()
    torch.set_num_threads(args.threads)
    log(f"protocol 1, pid {os.getpid()}; waiting for requests on stdin")
    return serve(HfEngine(log, args.attn_scale), log)


if __name__ == "__main__":
    sys.exit(main())
