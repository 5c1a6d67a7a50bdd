"""An HF model as every HF recorder (and engine_hf.py) runs it, in one place.

- make_deterministic(): torch on the CPU with one thread (a different thread
  count may change the reduction order inside matmuls, hence the last bits
  of every tensor), deterministic algorithms, no TF32.
- load(): the tokenizer and the model, eager attention (a mixture-of-experts
  model: eager experts too), float32 (a GGUF
  dequantised a block of rows at a time: hf_loading.lean_gguf_loading),
  every weight copied into a fresh aligned allocation (hf_loading.
  fresh_weights: the goldens depend on the weights only, not on the file's
  layout), then converted to the recording's dtype: float64 is the streamed
  oracle (oracle_f64.to_float64, run under an F32Guard), bfloat16/float16 a
  cast of the float32 weights with HF's own float32 islands kept; a spec's
  `config:` override merged into the config first (config_override.py).
- build_provenance(): the provenance of an HF stage golden (record_hf.py,
  record_vlm.py).
- sampling_processors(): HF's own logits processors (record_hf.py
  --sample-probs).
"""
import contextlib
import json
import os
import types

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

# Seeds of the tiny models (make_model.py's), recorded in every HF golden.
from make_model import SEEDS
import config_override
import golden_io
import oracle_f64
import rope_scaling_f64
from hf_loading import fresh_weights, lean_gguf_loading
from model_source import hf_versions, weights_provenance

DTYPES = ("float32", "float64", "bfloat16", "float16")


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


def read_config(folder):
    """An HF folder's config.json, as a dict."""
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def load(path, source, dtype, log, override=None):
    """Loads MODEL `path` (`source`: model_source.describe_source's answer,
    or None to skip the hashing: engine_hf.py) in `dtype` (one of DTYPES).
    `log(msg)` takes the progress lines (None: quiet). `override`: a spec's
    `config:` mapping (config_override.py), merged into the model's config
    before the model is built and asserted carried by it. Returns a
    namespace: tok, model, cfg, cfg_dict (config.json as saved, or for a
    GGUF the config transformers derived, as save_pretrained would write it;
    with an override, merged), model_bytes (the float32 size), and for
    float64 guard (the F32Guard to run every forward under), patched and
    f64_bytes (oracle_f64's)."""
    log = log or (lambda msg: None)
    transformers.utils.logging.disable_progress_bar()
    gguf = source["kind"] == "gguf" if source is not None else os.path.isfile(path)
    if gguf:
        load_dir, load_kw = os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
        if source is not None:
            log(f"{source['file']}: {source['architecture']} `{source['general_name']}`, "
                "dequantised to float32 by transformers' GGUF loader")
    else:
        load_dir, load_kw = path, {}
    log(f"loading {path}")
    tok = AutoTokenizer.from_pretrained(load_dir, **load_kw)
    cfg_kw, merged = {}, None
    if override is not None:
        cfg_kw["config"], merged = config_override.hf_config(load_dir, load_kw, gguf, override, "record_hf.py", log)
    if not gguf and golden_io.moe_layout(read_config(load_dir)) is not None:
        # A mixture-of-experts model: transformers' eager loop over the experts (its default, grouped_mm,
        # batches them differently), asserted per layer by moe_hooks.install.
        cfg_kw["experts_implementation"] = "eager"
    with lean_gguf_loading() if gguf else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(
            load_dir, dtype=torch.float32, attn_implementation="eager", **load_kw, **cfg_kw
        ).eval()
    fresh_weights(model)
    cfg = model.config
    assert model.model.layers[0].self_attn.config._attn_implementation == "eager"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "weights are not all float32"
    m = types.SimpleNamespace(tok=tok, model=model, cfg=cfg, guard=None, patched=None, f64_bytes=None)
    if gguf:
        m.cfg_dict = json.loads(cfg.to_json_string(use_diff=False))
    elif merged is not None:
        m.cfg_dict = merged
    else:
        with open(os.path.join(path, "config.json")) as f:
            m.cfg_dict = json.load(f)
    if override is not None:
        rope_type, att = config_override.check_applied(model, m.cfg_dict, merged, override)
        log(f"config override applied: rope_type {rope_type}, attention scaling {att:.9g}")
    m.model_bytes = oracle_f64.f32_bytes(model)
    log(f"loaded in float32: {m.model_bytes / oracle_f64.GIB:.2f} GiB, peak RSS so far "
        f"{oracle_f64.peak_rss() / oracle_f64.GIB:.2f} GiB")
    if dtype == "float64":
        m.guard = oracle_f64.F32Guard()
        m.patched = oracle_f64.to_float64(model, m.guard)
        m.f64_bytes = model.oracle_f64_bytes
        # A scaled RoPE (an override's too) runs rope_scaling_f64's float64 tables.
        assert getattr(model, "oracle_rope", None) is not None or not rope_scaling_f64.is_scaled(cfg), m.patched
        log(f"float64, streamed layer by layer ({m.patched})")
    elif dtype in ("bfloat16", "float16"):
        model.to(getattr(torch, dtype))
        assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())
        log(f"cast to {dtype} (HF's float32 islands kept)")
    else:
        assert dtype == "float32", dtype
    return m


def build_provenance(args, prompt, cfg_dict, greedy_ids, steps, cache_vs_full, source, record, sampling,
                     recorder):
    """The provenance of an HF stage golden (`recorder` is the script that
    wrote it). `args`: decode_steps, dtype and tokens_from (None or the
    golden whose tokens were fed)."""
    from golden_io import sha256_file
    prov = {
        "source": "hf",
        "recorder": recorder,
        "versions": hf_versions(),
        "prompt": prompt,
        "greedy_ids": greedy_ids,
        "decode_steps": args.decode_steps,
        "steps": steps,
        "model_config": cfg_dict,
        "seeds": SEEDS,  # make_model.py's; they describe the tiny models only
        "attn_implementation": "eager",
        "dtype": args.dtype,
        "tf32": False,
        "torch_threads": torch.get_num_threads(),
        "cache_vs_full_max_abs_diff": cache_vs_full,
    }
    weights_provenance(prov, source)
    if record is not None:
        prov["record"] = record
    if sampling is not None:
        prov["sampling"] = sampling["params"]
        prov["sampling_processors"] = sampling["processors"]
    if args.tokens_from is not None:
        prov["tokens_from"] = {"sha256": sha256_file(args.tokens_from)}
    if getattr(args, "override", None) is not None:
        # Exactly as given (a JSON object), compared with the spec's `config:`.
        prov["config_override"] = args.override
    return prov


def sampling_processors(model, sampling):
    """HF's own list for a fresh sampling config, built by the method
    generate() uses: exactly its order and its on/off conditions (record_hf.py
    --sample-probs)."""
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=True, temperature=sampling["temperature"], top_k=sampling["top_k"],
                          top_p=sampling["top_p"])
    procs = model._get_logits_processor(generation_config=gc, input_ids_seq_length=1, device="cpu")
    from transformers.generation import logits_process as lp
    want = ([lp.TemperatureLogitsWarper] if sampling["temperature"] != 1.0 else []) + \
           ([lp.TopKLogitsWarper] if sampling["top_k"] != 0 else []) + \
           ([lp.TopPLogitsWarper] if sampling["top_p"] < 1.0 else [])
    assert [type(p_) for p_ in procs] == want, f"HF's processors: {[type(p_).__name__ for p_ in procs]}"
    return procs, {"params": sampling, "processors": [type(p_).__name__ for p_ in procs]}
