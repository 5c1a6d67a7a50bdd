#!/usr/bin/env python3
"""Record golden tensors for every canonical stage with llama.cpp.

usage: record_llamacpp.py GGUF OUT_FILE --hf-golden HF_GOLDEN [--threads N]
                          [--steps STEP,...] [--stages PATTERN,...] [--logits all|last]
                          [--stages-at STEP=PATTERN,...] [--rows ROW,...] [--aux STEP=PATTERN,...]
                          [--kv-type f32|f16] [--oracle ORACLE] [--config-override JSON] [--list-nodes]

GGUF is used as it is, quantised or not (a real model's Q4_K_M file runs
as downloaded; the tiny models' F32 GGUFs come from convert_gguf.py).

Runs libllama (built by build_llamacpp.py from the pinned llama-cpp-python
sdist) through that sdist's low-level ctypes bindings (llama_cpp/llama_cpp.py,
loaded without the high-level package, never pip-installed) on EXACTLY the
token ids of the HF golden: `prefill/tokens` as one batch, then
`decode1/tokens`, `decode2/tokens`, ... one by one, at the HF golden's
positions (teacher forcing: both sources see identical inputs, whatever
llama.cpp would have predicted). Settings without which llama.cpp differs
from HF by ~3e-3: F32 K and V cache (the default F16 rounds them; `--kv-type
f16` records llama.cpp with its default cache, a reference whose arithmetic
says kv f16), flash attention DISABLED (and only then is there a softmax node to record), logits
for every token (else the last layer is pruned to the output rows). One
thread by default.

An eval callback (`cb_eval`, llamacpp_lib.NodeRecorder) copies the graph
nodes out as they are computed; NODE_MAP, the one table in llamacpp_graph.py,
turns llama.cpp node names of the pinned version into the canonical stages
and layouts of record_hf.py
(the same keys `<step>/<stage>`, the same shapes, checked against the HF
golden), plus `<step>/tokens` and `<step>/positions`. For Llama models the
converter permutes the rows of the Q and K weights (so llama.cpp's
interleaved-pair RoPE equals HF's rotate-half RoPE); the recorder undoes that
permutation on q, k, q_rope and k_rope so the golden is in HF's layout.

--steps/--stages/--stages-at/--logits/--rows/--aux store a subset, as in
record_hf.py; by default the same subset the HF golden stored (its provenance
`record`), so the two files have the same keys and shapes (asserted when
they stored the same subset). Tokens and positions are stored for every step.

An overflow is data, as in record_hf.py (overflow.py): every canonical stage
of every step is computed from the graph and watched in execution order; at
the first non-finite (step, stage) nothing more is stored (no later step is
decoded; every step's tokens and positions are still written, from the HF
golden), provenance `overflow` says where (`oracle_max_abs` from --oracle,
the float64 oracle's golden), greedy_ids keeps the steps whose logits were
finite, and the key-set comparison with the HF golden is left out. Exit 0
and one `overflow: ` line on stderr.

blk.{i}.attn_scores [H,T,S] is record_hf.py's stage (the scaled scores
q_rope . k_rope^T / sqrt(D), the softmax input before the mask, causally
masked entries exactly 0), which llama.cpp never materialises: its graph
computes kq-L (MUL_MAT, unscaled) and ggml_soft_max_ext applies kq_scale
inside the softmax. The recorder takes kq-L, slices it from the padded KV
length to S, multiplies it in float32 by the kq_scale of the SOFT_MAX node
(its op_params; exactly what the op computes before adding the mask) and
zeroes the causally masked entries (see llamacpp_graph.NODE_MAP). For Phi-3 the graph scales
Q before kq (kq_scale 1), so the stored scores are kq as it is; so does
Gemma 3's, after RoPE (an unnamed SCALE node by f_attention_scale,
1/sqrt(head_dim) for every size but the 27B, which must equal HF's
query_pre_attn_scalar^-0.5: asserted), so its scores are
(q_rope * scale) . k_rope^T.

If every logits row of the HF golden ties in pairs (logits[2j] == logits[2j+1]
bit for bit: phi3-tiny's LM head has rows equal in pairs), llama.cpp's logits
must tie the same way and every greedy id must be even; asserted.

Architectures: qwen2, llama, qwen3 (per-head q/k RMSNorm: `Qcur_normed-L`,
`Kcur_normed-L`), phi3 (fused `wqkv-L` and fused up/gate `ffn_up-L`,
split into the canonical q/k/v and ffn_gate/ffn_up here) and gemma3 (HF
model_type gemma3_text; see NODE_MAP's gemma3 entry), and the
mixture-of-experts llama (Mixtral), qwen2moe, qwen3moe, gpt-oss and
deepseek2 (DeepSeek-V3): their router, top-k, weights and expert nodes
(build_moe_ffn's) are MOE_NODE_MAP's, the stages of each layer
golden_io.moe_layout's of the HF golden's config. DeepSeek-V3's attention is
llama.cpp's absorbed MLA, which never forms the per-head k, v and k_rope:
those stages are left out of its golden (llamacpp_graph.ABSENT_STAGES,
provenance `absent_stages` with the reason).

Sliding-window attention (gemma3): the context keeps a full-size SWA cache
(swa_full = true, llama.cpp's default, pinned: provenance
`settings.swa_full`), so cell p holds position p in every layer's cache and
the [H,T,S] columns are positions, as for full attention. Which layers
slide and how far is asserted from the graph, against the HF config's
layer_types and sliding_window: every attn_probs entry masked by the causal
mask or the layer's window (query - key >= sliding_window) is exactly 0, every
other one is > 0 in some head, a full-attention layer has non-zero entries
beyond the window, and each layer's RoPE of Q and K uses its layer type's
base (ROPE op_params freq_base: rope.freq_base_swa on sliding layers). The
stored attn_scores are zeroed on the same masked entries.

A model whose HF config slides where llama.cpp does not (Qwen2 with
use_sliding_window: llama.cpp's qwen2 has no sliding window) is recorded as
llama.cpp computes it, full attention: the masks and checks follow the
windows llama.cpp applies (llama_model_n_swa 0: none), and provenance
`sliding_window` says what HF asked and what was applied
(llamacpp_scaling.py).

A scaled RoPE (HF rope_type linear, dynamic, yarn, longrope, llama3) is
recorded as llama.cpp does it, which is not always HF's (dynamic: plain
RoPE; YaRN: correction range always truncated; LongRoPE: long or short
factors by the context's n_ctx_seq, not the pass length; llamacpp_scaling.py
lists them). Provenance `rope_scaling`: the GGUF's rope and context keys,
the context (n_ctx, n_ctx_seq, n_ctx_train, rope_freq_scale_train), and the
ROPE parameters of the graph (the same in every step: asserted), factors
tensor included.

--config-override JSON (a spec's `config:`, as `touchstone goldens regen`
passes it to both recorders) must be the override the HF golden was
recorded with (its provenance `config_override`; the HF golden's
model_config is then the merged config). The GGUF runs as it is and
llama.cpp is given the override's RoPE through its context parameters
(llamacpp_scaling.override_context): YaRN as rope_scaling_type YARN,
rope_freq_scale 1/factor, yarn_orig_ctx original_max_position_embeddings,
yarn_ext_factor 1, yarn_beta_fast/slow (HF's 32/1 unless given); llama.cpp
itself then makes the attention factor 0.1 ln(factor) + 1, HF's. Linear
scaling and rope_theta are expressible too; anything else (dynamic,
LongRoPE, Llama 3, YaRN with truncate false or another attention factor,
other config keys) is refused, exit 2. The graph's ROPE op_params are then
asserted to be what was given, and the frequencies and attention factor
they make (in float64) HF's within float32 rounding. Provenance:
`config_override` as given, and `rope_scaling` with `context_params` (what
llama.cpp was given) and that check.

A prompt longer than 256 tokens gets a context of the next multiple of
256 (256 otherwise, as always). With a subset the eval callback copies only
the nodes of the stages stored (and the logits); every other node is only
checked for finiteness (llamacpp_lib.NodeRecorder's `keep`).

Gemma 3's GELU: ggml's CPU GEGLU (ggml_vec_geglu_f32, GGML_GELU_FP16 is
defined unconditionally in ggml-cpu/vec.h) rounds the gate to float16 and
looks the GELU up in a float16 table for |gate| < 10, then multiplies by up
in float32: its ffn_act is about 1e3 float32 roundings from the oracle
(5e-4 relative), and everything after the first layer's FFN inherits that.
The golden records it as it is: it is llama.cpp's arithmetic.

`__metadata__`: `format` = touchstone-golden/1 and `provenance` (compact
sorted JSON). Nothing in the output varies between runs (no time, host or
path): a rerun is byte-for-byte identical.
"""
import argparse
import json
import os
import sys

import numpy as np
from safetensors import safe_open

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_llamacpp  # noqa: E402
import golden_io  # noqa: E402
from golden_io import FORMAT, progress, sha256_file  # noqa: E402
import llamacpp_lib as lib  # noqa: E402  (libllama: bindings, eval callback, context)
import llamacpp_scaling  # noqa: E402  (what llama.cpp was given: RoPE scaling, sliding window)
import config_override  # noqa: E402  (a spec's `config:` mapping)
import overflow  # noqa: E402  (a forward that overflows is data)
# The node map: which graph node is which stage, in the canonical layout.
from llamacpp_graph import (ABSENT_STAGES, HF_MODEL_TYPE_ARCH, QK_PERMUTED, ROPE_TYPE, LeanNodes,  # noqa: E402
                            attention_layout, canonical, check_rope_bases, computable)
from llamacpp_lib import NodeRecorder, load_bindings, versions_and_build  # noqa: E402
from overflow import STANDIN  # noqa: E402  (a stage not stored, finite)

RECORDER = "goldens/recorders/record_llamacpp.py"


def log(msg):
    progress("record_llamacpp.py", msg)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out_file")
    ap.add_argument("--hf-golden", required=True, help="take the token ids (and steps) from this HF golden")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", default=None,
                    help="comma-separated steps to store (default: those the HF golden stored)")
    ap.add_argument("--stages", default=None,
                    help="comma-separated stage patterns to store (default: those the HF golden stored)")
    ap.add_argument("--stages-at", action="append", default=None, metavar="STEP=PATTERN[,PATTERN]",
                    help="also store these stages at this one step (default: the HF golden's stages_at)")
    ap.add_argument("--logits", choices=["all", "last"], default=None,
                    help="`last`: only the last row of each step's logits (default: as the HF golden)")
    ap.add_argument("--rows", default=None, metavar="ROW[,ROW]",
                    help="keep only these token rows of every stage (default: the HF golden's rows)")
    ap.add_argument("--aux", action="append", default=None, metavar="STEP=PATTERN[,PATTERN]",
                    help="also store these stages at this step with every token row (default: the HF golden's aux)")
    ap.add_argument("--aux-rows", action="append", default=None, metavar="STEP=PATTERN[,PATTERN]",
                    help="also store these stages at this step on the kept rows (default: the HF golden's aux_rows)")
    ap.add_argument("--oracle", default=None, metavar="ORACLE",
                    help="the float64 oracle's golden: an overflow's provenance gives its largest |x| there")
    ap.add_argument("--kv-type", choices=["f32", "f16"], default="f32",
                    help="K and V cache type: f32 (default; closest to HF) or f16 (llama.cpp's own default)")
    ap.add_argument("--config-override", default=None, metavar="JSON",
                    help="the spec's `config:` mapping the HF golden was recorded with (config_override.py); "
                         "llama.cpp is given its RoPE through the context parameters")
    ap.add_argument("--list-nodes", action="store_true",
                    help="print every graph node (step, index, name, op, numpy shape) to stderr")
    ap.add_argument("--cache-dir", default=build_llamacpp.DEFAULT_CACHE,
                    help="build_llamacpp.py's cache (sdist, source, build)")
    args = ap.parse_args()
    for path, what in ((args.gguf, "GGUF"), (args.hf_golden, "--hf-golden")):
        if not os.path.isfile(path):
            ap.error(f"{what} {path} does not exist")
    with open(args.gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            ap.error(f"{args.gguf} is not a GGUF file (no GGUF magic)")
    if args.oracle is not None:
        overflow.check_oracle(args.oracle)
    args.override = None if args.config_override is None else config_override.parse(args.config_override,
                                                                                     "record_llamacpp.py")
    return ap, args


def read_hf_golden(ap, path):
    """(tensors, provenance) of the HF golden."""
    hf = {}
    with safe_open(path, "np") as f:
        hf_meta = f.metadata() or {}
        for k in f.keys():
            hf[k] = f.get_tensor(k)
    if hf_meta.get("format") != FORMAT:
        ap.error(f"--hf-golden {path} is not a {FORMAT} file (format {hf_meta.get('format')!r})")
    return hf, json.loads(hf_meta["provenance"])


def selection(ap, args, hf_prov, model_type, n_layer, steps, layout=None):
    """What to store: as asked, else what the HF golden stored (its
    `record`). A namespace: keep_steps, patterns, keep, stages_at,
    stages_at_sets, aux, aux_sets, logits, rows. `layout`: a MoE model's
    golden_io.moe_layout."""
    hf_rec = hf_prov.get("record") or {}
    sel = argparse.Namespace()
    try:
        sel.keep_steps = golden_io.parse_steps(
            args.steps if args.steps is not None else ",".join(hf_rec.get("steps", steps)), len(steps) - 1)
        sel.patterns, sel.keep = golden_io.parse_stages(
            args.stages if args.stages is not None else ",".join(hf_rec.get("stages", ["*"])), model_type, n_layer,
            layout=layout)
        stages_at_args = args.stages_at if args.stages_at is not None else \
            [f"{k}={','.join(v)}" for k, v in (hf_rec.get("stages_at") or {}).items()]
        sel.stages_at, sel.stages_at_sets = golden_io.parse_stages_at(stages_at_args, model_type, n_layer,
                                                                      len(steps) - 1, layout=layout)
        aux_args = args.aux if args.aux is not None else \
            [f"{k}={','.join(v)}" for k, v in (hf_rec.get("aux") or {}).items()]
        sel.aux, sel.aux_sets = golden_io.parse_stages_at(aux_args, model_type, n_layer, len(steps) - 1,
                                                          what="--aux", layout=layout)
        aux_rows_args = args.aux_rows if args.aux_rows is not None else \
            [f"{k}={','.join(v)}" for k, v in (hf_rec.get("aux_rows") or {}).items()]
        sel.aux_rows, sel.aux_rows_sets = golden_io.parse_stages_at(aux_rows_args, model_type, n_layer,
                                                                    len(steps) - 1, what="--aux-rows", layout=layout)
        sel.logits = args.logits or hf_rec.get("logits", "all")
        sel.rows = golden_io.parse_rows(args.rows) if args.rows is not None else hf_rec.get("rows_asked")
    except golden_io.SelectionError as e:
        ap.error(str(e))
    return sel


def disagreement_of(step, index, mine_id, hf_pick, mine, hf_logits):
    """A step whose greedy pick is not HF's: a near-tie that llama.cpp's
    arithmetic (8-bit activations, f16 K/V) resolves the other way is normal
    on quantised models; the references stay fed HF's tokens (teacher
    forcing), so both goldens remain comparable. Recorded as data: both
    picks and each side's margin between them."""
    return {
        "step": step,
        "index": index,
        "hf_id": hf_pick,
        "llamacpp_id": mine_id,
        "llamacpp_margin": float(mine[mine_id]) - float(mine[hf_pick]),
        "hf_margin": None if hf_logits is None else float(hf_logits[-1][hf_pick]) - float(hf_logits[-1][mine_id]),
    }


def main():
    ap, args = parse_args()
    lib_dir, binfo = build_llamacpp.ensure_built(os.path.abspath(args.cache_dir))
    src = build_llamacpp.source_dir(os.path.abspath(args.cache_dir))
    lc, g = load_bindings(src, lib_dir)

    # ---- the HF golden: steps, tokens, positions ----------------------------
    hf, hf_prov = read_hf_golden(ap, args.hf_golden)
    steps = hf_prov["steps"]
    prompt_ids = [int(x) for x in hf["prefill/tokens"]]
    assert prompt_ids == hf_prov["prompt"]["token_ids"]
    hf_cfg = hf_prov["model_config"]
    if hf_prov.get("config_override") != args.override:
        print(f"record_llamacpp.py: --config-override {json.dumps(args.override)}, but the HF golden "
              f"{args.hf_golden} was recorded with {json.dumps(hf_prov.get('config_override'))}: give the override "
              "it was recorded with (both references must run the same model)", file=sys.stderr)
        sys.exit(2)
    n_layer = hf_cfg["num_hidden_layers"]
    dims = golden_io.model_dims(hf_cfg)
    layout = golden_io.moe_layout(hf_cfg)  # a MoE model's dense and routed layers (None: dense)
    sel = selection(ap, args, hf_prov, hf_cfg["model_type"], n_layer, steps, layout)
    step_tokens = {}  # {step: T}, for the row subset
    # The HF golden's LM head has rows equal in pairs (phi3-tiny) when all its
    # recorded logit pairs tie bit for bit: then llama.cpp's must too, and
    # every greedy id must be even (argmax picks the lowest index of a tie).
    hf_logits = [v for k, v in hf.items() if k.endswith("/logits")]
    pair_ties = bool(hf_logits) and hf_cfg["vocab_size"] % 2 == 0 and all(
        np.array_equal(v[:, 0::2].view(np.uint32), v[:, 1::2].view(np.uint32)) for v in hf_logits)
    if pair_ties:
        log("the HF golden's logits tie in pairs: checking llama.cpp's ties and even greedy ids")

    # ---- model and context ----------------------------------------------------
    log(f"loading {args.gguf}")
    lib.silence(lc)
    model = lib.open_model(lc, args.gguf)
    if not model:
        sys.exit(f"record_llamacpp.py: libllama could not load {args.gguf} (an architecture or tensor type "
                 "this llama.cpp does not know?)")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    arch = lib.meta_str(lc, model, "general.architecture")
    assert arch, "GGUF without general.architecture"
    rope_type = lc.llama_model_rope_type(model)
    if arch not in ROPE_TYPE:
        sys.exit(f"record_llamacpp.py: architecture {arch!r} has no node map (known: {sorted(ROPE_TYPE)})")
    assert rope_type == ROPE_TYPE[arch], f"arch {arch}, rope type {rope_type}"
    permuted = arch in QK_PERMUTED
    assert HF_MODEL_TYPE_ARCH.get(hf_cfg["model_type"], hf_cfg["model_type"]) == arch, (hf_cfg["model_type"], arch)
    # Read now: the model is freed before the provenance is written.
    general_name, file_type = lib.meta_str(lc, model, "general.name"), lib.meta_str(lc, model, "general.file_type")
    attn = attention_layout(hf_cfg, arch, dims)
    swa_entry = None
    if any(w is not None for w in attn["windows"]):
        swa, n_swa = lib.meta_str(lc, model, f"{arch}.attention.sliding_window"), lc.llama_model_n_swa(model)
        if n_swa == 0:
            # HF slides, llama.cpp does not (Qwen2: its converter writes no
            # sliding_window, llama_model_qwen2 builds full attention): the
            # golden records llama.cpp's full attention, the masks and checks
            # below follow what llama.cpp applies; provenance `sliding_window`.
            attn = dict(attn, windows=[None] * n_layer)
            swa_entry = llamacpp_scaling.sliding_window_entry(hf_cfg, arch, swa, n_swa, attn["windows"])
            log(f"HF slides (window {hf_cfg['sliding_window']}), llama.cpp applies no window (n_swa 0)")
        else:
            # llama.cpp's window is the GGUF's; which layers slide is checked
            # on the graph (attn_probs' zeros, each layer's RoPE base).
            assert swa is not None and int(swa) == hf_cfg["sliding_window"] == n_swa, (swa, hf_cfg["sliding_window"])
    sliding = any(w is not None for w in attn["windows"])  # as llama.cpp applies it
    log(f"{arch} `{general_name}`, {n_layer} layers, vocab {n_vocab}")

    # llama.cpp's own tokenization of the prompt text: recorded, and must
    # agree with HF's (the tokens fed are HF's either way). A chat prompt is
    # the rendered template, whose special tokens must be parsed as such.
    # A prompt given as token ids has no text: nothing to tokenize.
    chat = bool(hf_prov["prompt"].get("chat"))
    given_tokens = hf_prov["prompt"].get("given") == "tokens"
    lcpp_ids = None
    if not given_tokens:
        text = hf_prov["prompt"].get("rendered", hf_prov["prompt"]["text"]).encode()
        n_max = len(text) + 16
        tbuf = (lc.llama_token * n_max)()
        nt = lc.llama_tokenize(vocab, text, len(text), tbuf, n_max, False, chat)
        assert nt >= 0, "tokenize failed"
        lcpp_ids = list(tbuf[:nt])
        assert lcpp_ids == prompt_ids, f"llama.cpp tokenizes the prompt as {lcpp_ids}, HF as {prompt_ids}"

    n_total = sum(len(hf[f"{s}/tokens"]) for s in steps)
    rec = NodeRecorder(g)
    cb = lc.ggml_backend_sched_eval_callback(rec.callback)  # keep a reference while ctx lives
    # Sliding-window layers: a full-size SWA cache (n_ctx cells, the
    # context's default, pinned here), so that, in a fresh context, token p
    # lands in cell p of every layer's cache as in the full-attention cache:
    # the recorder reads column j of kq/attn_probs as position j. A small SWA
    # cache (swa_full false: n_swa + n_ubatch cells) may hand a cell whose
    # position left the window to a later token, and the columns would no
    # longer be positions. The window itself is applied by llama.cpp's SWA
    # mask either way; the zeros are checked in canonical().
    # 256 as always (a LongRoPE model's factors depend on it), more for a longer prompt.
    cparams = lib.context_params(lc, max(256, -(-n_total // 256) * 256), args.threads, args.kv_type, cb,
                                 swa_full=True)
    given = None
    if args.override is not None:
        # The override's RoPE, through the context parameters (or exit 2).
        given = llamacpp_scaling.override_context(lc, cparams, hf_cfg, args.override,
                                                  llamacpp_scaling.gguf_keys(lc, model, arch), arch)
        log(f"config override: llama.cpp given {json.dumps(given, sort_keys=True)}")
    ctx = lc.llama_init_from_model(model, cparams)
    assert ctx, "context init failed"
    # A scaled RoPE: what llama.cpp was given (GGUF keys, the context, and
    # every step's ROPE parameters from the graph; llamacpp_scaling.py).
    scaled = llamacpp_scaling.rope_scaled(hf_cfg) or given is not None
    rope_context = {"n_ctx": lc.llama_n_ctx(ctx), "n_ctx_seq": lc.llama_n_ctx_seq(ctx),
                    "n_ctx_train": lc.llama_model_n_ctx_train(model),
                    "rope_freq_scale_train": lc.llama_model_rope_freq_scale_train(model)} if scaled else None
    rope_keys = llamacpp_scaling.gguf_keys(lc, model, arch) if scaled else None
    rope_steps = {}

    out, greedy_ids, api_vs_graph = {}, [], 0.0
    disagreement = None  # the first step whose greedy pick is not HF's
    batch = lc.llama_batch_init(cparams.n_batch, 0, 1)
    pos_next = 0
    # every stage the graph computes, in execution order (ABSENT_STAGES: MLA's per-head k and v)
    absent = ABSENT_STAGES.get(arch, {})
    order = [s for s in golden_io.all_stages(arch, n_layer, layout=layout) if s.split(".")[-1] not in absent]
    lean = sel.keep_steps != steps or sel.patterns != ["*"] or sel.logits != "all" or sel.rows is not None
    watch = overflow.Watch("float32", args.oracle)  # llama.cpp's activations: f32
    try:
        for step in steps:
            toks = [int(x) for x in hf[f"{step}/tokens"]]
            positions = [int(x) for x in hf[f"{step}/positions"]]
            assert positions == list(range(pos_next, pos_next + len(toks))), f"{step}: positions {positions}"
            step_tokens[step] = len(toks)
            pos_next = positions[-1] + 1
            if watch.found is not None:
                # After an overflow: the tokens fed, nothing else.
                out[f"{step}/tokens"] = np.array(toks, dtype=np.int64)
                out[f"{step}/positions"] = np.array(positions, dtype=np.int64)
                continue
            log(f"{step}: {len(toks)} token(s) at position {positions[0]}")
            rec.nodes = []
            want = (sel.keep if step in sel.keep_steps else set()) | sel.stages_at_sets.get(step, set()) | \
                sel.aux_sets.get(step, set()) | sel.aux_rows_sets.get(step, set())
            if lean:  # only the nodes of the stored stages (and the logits, for the greedy pick and checks)
                rec.keep = LeanNodes(arch, n_layer, want | {"logits"}, layout=layout)
            lib.fill_batch(batch, toks, positions)
            rc = lc.llama_decode(ctx, batch)
            assert rc == 0, f"llama_decode returned {rc}"
            S = positions[-1] + 1
            if args.list_nodes:
                for i, nd in enumerate(rec.nodes):
                    print(f"{step} {i:4d} {nd['name']:<22} {nd['op']:<10} {list(reversed(nd['ne']))}", file=sys.stderr)
            check_rope_bases(rec.nodes, step, attn)
            if scaled:
                rope_steps[step] = llamacpp_scaling.rope_graph(rec.nodes, n_layer, step)
            # Every stage (the overflow watch looks at all of them); the
            # masked-entry checks on the stages stored, as always.
            # (lean: the stages whose nodes were kept; the others are finite, STANDIN)
            some = computable(rec.nodes, arch, n_layer, set(order), layout) if lean else set(order)
            stages = canonical(rec.nodes, step, arch, n_layer, len(toks), S, permuted, dims, some, positions,
                               attn, checked=want, finite=False, layout=layout)
            stages.update({st: STANDIN for st in order if st not in stages})
            rec.nodes = []  # a real model's nodes are large; drop them now
            lg = stages["logits"]
            finite_logits = bool(np.isfinite(lg).all())
            if finite_logits:
                api_vs_graph = max(api_vs_graph, lib.logits_vs_graph(lc, ctx, lg))
            else:
                api = lib.all_logits(lc, ctx, len(toks), n_vocab)
                assert np.array_equal(api, lg, equal_nan=True), "llama_get_logits_ith differs from result_output"
            watch.scan(step, stages, order)
            if finite_logits:
                greedy_ids.append(int(lg[-1].argmax()))
                log(f"{step}: greedy token {greedy_ids[-1]}")
                hf_ids = hf_prov["greedy_ids"]
                hf_pick = hf_ids[len(greedy_ids) - 1] if len(greedy_ids) <= len(hf_ids) else None
                if disagreement is None and hf_pick is not None and greedy_ids[-1] != hf_pick:
                    disagreement = disagreement_of(step, len(greedy_ids) - 1, greedy_ids[-1], hf_pick, lg[-1],
                                                   hf.get(f"{step}/logits"))
                    log(f"{step}: greedy token {greedy_ids[-1]}, HF's {hf_pick} (llama.cpp's margin "
                        f"{disagreement['llamacpp_margin']:.3g})")
                if pair_ties:
                    assert np.array_equal(lg[:, 0::2].view(np.uint32), lg[:, 1::2].view(np.uint32)), \
                        f"{step}: the HF golden's logit pairs tie exactly, llama.cpp's do not"
                    assert greedy_ids[-1] % 2 == 0, f"{step}: greedy id {greedy_ids[-1]} is odd despite the tied pairs"
            stages["tokens"] = np.array(toks, dtype=np.int64)
            stages["positions"] = np.array(positions, dtype=np.int64)
            kept = golden_io.select_step(step, stages, sel, len(toks), lambda k: watch.keeps(step, k))
            out.update({f"{step}/{k}": v for k, v in kept.items()})
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    assert api_vs_graph == 0.0, f"llama_get_logits_ith differs from result_output by {api_vs_graph}"
    # Same keys and shapes as the HF golden when both stored the same subset
    # (and neither overflowed: each then stops where its own forward did).
    record = golden_io.record_section(sel.keep_steps, steps, sel.patterns, sel.logits, sel.stages_at, sel.rows,
                                      step_tokens, sel.aux, sel.aux_rows)
    if record == hf_prov.get("record") and watch.found is None and "overflow" not in hf_prov:
        # sample_probs (record_hf.py --sample-probs) has no llama.cpp counterpart.
        hf_keys = sorted(k for k in hf if not k.endswith("/sample_probs") and k.split(".")[-1] not in absent)
        assert sorted(out) == hf_keys, \
            f"stage set differs from the HF golden's: {sorted(set(out) ^ set(hf_keys))[:10]}"
        for k, v in out.items():
            assert v.shape == hf[k].shape, f"{k}: {v.shape} vs the HF golden's {hf[k].shape}"

    gguf_sha = sha256_file(args.gguf)
    versions, build = versions_and_build(binfo)
    prov = {
        "source": "llama.cpp",
        "recorder": RECORDER,
        "versions": versions,
        "build": build,
        "settings": {
            "kv_cache_type": args.kv_type,
            "flash_attn": "disabled",
            "n_threads": args.threads,
            "n_ctx": cparams.n_ctx,
            "n_gpu_layers": 0,
            "logits": "all tokens",
            "tokens": "teacher-forced from the HF golden",
        },
        "gguf_sha256": gguf_sha,
        "gguf_architecture": arch,
        "qk_unpermuted": permuted,
        "hf_golden_sha256": sha256_file(args.hf_golden),
        "prompt": ({"given": "tokens", "token_ids": prompt_ids} if given_tokens else
                   {"text": hf_prov["prompt"]["text"], "token_ids": prompt_ids, "llamacpp_token_ids": lcpp_ids}),
        "greedy_ids": greedy_ids,
        "decode_steps": len(steps) - 1,
        "steps": steps,
        "model_config": hf_cfg,
    }
    if absent:  # (architectures whose graph lacks some stages only)
        prov["absent_stages"] = absent
    if sliding:
        # Sliding-window models only (other goldens keep their provenance).
        prov["settings"]["swa_full"] = True
    if swa_entry is not None:
        prov["sliding_window"] = swa_entry
    if scaled and rope_steps:
        prov["rope_scaling"] = llamacpp_scaling.rope_provenance(hf_cfg, rope_keys, rope_context, rope_steps)
        if given is not None:
            # What llama.cpp was given for the override, and the graph's check of it.
            prov["rope_scaling"]["context_params"] = given
            if "rope_scaling_type" in given:
                prov["rope_scaling"]["rope_scaling_type"] = f"{given['rope_scaling_type']} (context_params)"
            prov["rope_scaling"]["override_check"] = llamacpp_scaling.check_override(prov["rope_scaling"]["graph"],
                                                                                    given, hf_cfg)
    if args.override is not None:
        prov["config_override"] = args.override
    if chat:
        prov["prompt"].update(chat=True, rendered=hf_prov["prompt"]["rendered"])
    if disagreement is not None:
        prov["greedy_disagreement"] = dict(disagreement, hf_greedy_ids=hf_prov["greedy_ids"])
    # When the HF golden was recorded from this very GGUF, the GGUF is the
    # model under test (not a conversion made for the recording, whose file
    # name means nothing): name it. Converted tiny models keep the provenance
    # they always had, so their goldens stay byte-identical.
    if hf_prov.get("gguf_sha256") == gguf_sha:
        prov["model"] = {"format": "gguf", "file": os.path.basename(args.gguf), "sha256": gguf_sha,
                         "general_name": general_name, "architecture": arch,
                         "file_type": None if file_type is None else int(file_type)}
    if record is not None:
        prov["record"] = record
    if watch.found is not None:
        prov["overflow"] = watch.found
        prov["overflow_skipped"] = overflow.skipped(watch.found, [], [], [])
    golden_io.write_golden(out, golden_io.metadata(prov), args.out_file, log)
    print(json.dumps({
        "out": args.out_file,
        "tensors": len(out),
        "bytes": os.path.getsize(args.out_file),
        "sha256": sha256_file(args.out_file),
        "architecture": arch,
        "qk_unpermuted": permuted,
        "prompt_ids": prompt_ids,
        "greedy_ids": greedy_ids,
        "hf_greedy_ids": hf_prov["greedy_ids"],
    }))
    if disagreement is not None:
        d = disagreement
        print(f"record_llamacpp.py: warning: greedy ids differ from the HF golden's at {d['step']}: llama.cpp "
              f"{d['llamacpp_id']}, HF {d['hf_id']} (llama.cpp's margin {d['llamacpp_margin']:.3g}, HF's "
              f"{'not recorded' if d['hf_margin'] is None else format(d['hf_margin'], '.3g')}); both goldens "
              f"are written, the provenance's greedy_disagreement says so", file=sys.stderr)
    watch.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
