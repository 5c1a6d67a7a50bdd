#!/usr/bin/env python3
"""Record next-token goldens: each source's next-token distribution over a prompt set.

usage: record_next_token.py MODEL OUT_FILE --prompts SET.yaml --source NAME
                            [--dtype float32|float64|bfloat16|float16]
                            [--tokens-from FILE] [--oracle FILE] [--k K]
                            [--kv-type f32|f16] [--arithmetic JSON]
                            [--threads N] [--cache-dir DIR]

The goldens of touchstone's `next_token` run check (logits-only verdicts: KL
divergence, top-1 and top-k agreement of an engine's next-token distribution
with a float64 oracle's). For every prompt of SET.yaml (a prompt set,
goldens/prompt-sets/*.yaml: `prompts`, a list of {name, text}), ONE forward
pass over the text's whole token sequence (teacher forcing on the text's own
tokens) gives the distribution of the next token at every position t (after
tokens[0..=t]); the file keeps each position's top K.

--source names the golden source, and with it the engine and dtype:

  oracle     HF transformers in float64, built exactly as record_hf.py
             --dtype float64 builds it (the float32 weights widened to
             float64 layer by layer while each runs, HF's float32 islands --
             RoPE tables, RMSNorm, the attention softmax -- replaced by
             float64 ones: oracle_f64.py's to_float64; a dispatch guard
             asserts no op produced another float dtype)
  hf         HF transformers in float32 (record_hf.py's default)
  hf-bf16    the same float32 weights cast to bfloat16 after loading, HF's
  hf-f16     own code as it is (record_hf.py --dtype bfloat16 / float16)
  llama.cpp  libllama (build_llamacpp.py's build, through the sdist's ctypes
             bindings, as record_llamacpp.py loads it) running the GGUF as it
             is (MODEL must be a .gguf): flash attention disabled, one batch
             with logits for every token, one thread by default, a fresh
             context per prompt, the K/V cache of --kv-type (f32 default;
             regen passes f16 where the spec's scaled.arithmetic declares kv
             f16 for llama.cpp, as for record_llamacpp.py)

--dtype may be given but must agree with --source (oracle float64, hf
float32, hf-bf16 bfloat16, hf-f16 float16). The HF sources load MODEL as
record_hf.py does (an HF folder, or a .gguf dequantised to float32 by
transformers' GGUF loader; CPU, eager attention, one thread, deterministic
algorithms, no TF32, every parameter copied to a fresh aligned allocation).

Tokens. The HF sources tokenise each text with the model's tokenizer (HF's,
from the folder or the GGUF) exactly as record_hf.py tokenises a --prompt:
no chat template, add_special_tokens=True (a BOS only where the tokenizer
adds one; Qwen2's adds none). --tokens-from FILE (a next-token golden of the
same prompt set, normally the `hf` one) feeds that file's ids unchanged; an
HF source then asserts that its own tokenisation gives the same ids.
llama.cpp is always fed the ids of --tokens-from (else of --oracle), and its
own tokenisation of each text (llama_tokenize with add_special, without
parse_special: what HF's add_special_tokens=True does) must agree:
asserted, with both id lists in the error. The one difference tolerated is
a BOS llama.cpp adds where HF's tokenizer adds none (llama-tiny's GGUF says
add_bos_token, its HF tokenizer adds nothing): the ids fed stay the ones
given, and provenance `tokenization.adds_bos_not_fed` names the prompts
(Qwen2's tokenizers agree: `matches_tokens_fed` true).

--oracle FILE (every source but the oracle itself, required): the oracle's
next-token golden of the same prompt set; its tokens must equal this run's,
and this source's log-probabilities at the oracle's top-K ids are stored
(`at_oracle`). --k K (default 16) must be the oracle's.

Output: one safetensors file, `__metadata__` = {"format":
"touchstone-next-token/1", "provenance": compact sorted-key JSON}. For each
prompt, in the set's order, with its name N and T tokens:

  N/tokens        I64 [T]    the token ids fed
  N/top_ids       I64 [T,K]  this source's top-K ids at each position, by
                             descending log-probability, ties broken to the
                             lower id
  N/top_logprobs  F64 [T,K]  this source's log-probabilities at those ids
  N/at_oracle     F64 [T,K]  (every source but the oracle) this source's
                             log-probabilities at the oracle's N/top_ids,
                             in that order
  N/logit_max     F64 [T]    max |logit| over the whole vocabulary at each
                             position (this source's own logits)

Log-probabilities are log_softmax over the whole vocabulary (every row of
the LM head, padding rows included) computed in float64 (x - max, then
log(sum(exp)), numpy) from the source's logits upcast exactly to float64
(float32, bfloat16 and float16 logits are exact in float64).

Provenance: source, dtype (HF sources), arithmetic (llama.cpp: the map the
spec declares, --arithmetic, else {storage f32, activations exact, kv
--kv-type} for an F32/F16 GGUF), k, n_vocab, prompt_set {path, sha256} (the
path relative to this checkout's root when the file is inside it, else as
given), prompts (the names written, in order), token_counts (theirs), the
model (model_source.py's keys: gguf_sha256 and `model` for a GGUF,
model_sha256 / hf_model_sha256 and tokenizer_sha256 for an HF folder),
model_config (as record_hf.py stores it; llama.cpp copies the oracle's),
tool versions, settings, tokenisation details, and the sha256 of
--tokens-from and --oracle. Nothing that varies between runs (no time,
host, pid or absolute path): a rerun is byte-identical.

An overflow is data (overflow.py). A prompt whose logits are not all finite
is left out of the file (no tensor of it; `prompts` and `token_counts` list
the others) and named in provenance `overflow`: {dtype, prompts: [{prompt,
position: the first position whose logits are non-finite, stage: the
earliest stage of that forward holding a non-finite value (every stage
tapped again, in execution order, with the stage recorders' hooks or node
map; `logits` where it cannot tell: llama.cpp without a model config), row:
that stage's first such token row, nonfinite and max_abs_finite_before of
that stage's tensor, oracle_max_abs: the --oracle file's largest |logit|
over the prompt when the stage is `logits` (else null: the file holds no
other stage), oracle_logit_max: its max |logit| at `position`, tokens: the
ids fed}]}. The other prompts are written as before, so the format stays
touchstone-next-token/1: every prompt `prompts` lists has all its tensors. A
--tokens-from file gives a left-out prompt's ids from its entry; an --oracle
that left a prompt out is refused (exit 2: nothing to measure against).
Exit 0 and one line on stderr starting `overflow: `.

User errors (a missing file, bad YAML, an unknown key, a duplicate or badly
formed name, an empty text, K < 1, tokens that differ from --tokens-from or
--oracle, ...) exit 2 with one line, no traceback.
"""
import argparse
import contextlib
import json
import os
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import yaml  # noqa: E402

import golden_io  # noqa: E402
from golden_io import progress, sha256_file  # noqa: E402
from next_token_io import (FORMAT, UserError, distribution_summary, left_out, overflowed, read_golden,  # noqa: E402
                           read_prompt_set, set_path_for_provenance)

RECORDER = "goldens/recorders/record_next_token.py"
TOOL = "record_next_token.py"
# source -> HF dtype (None: llama.cpp)
SOURCES = {"oracle": "float64", "hf": "float32", "hf-bf16": "bfloat16", "hf-f16": "float16", "llama.cpp": None}
N_CTX = 256  # record_llamacpp.py's context (and batch) size


def log(msg):
    progress(TOOL, msg)


# ---- HF ------------------------------------------------------------------------------
def hf_run(args, prompts, forced):
    """Loads MODEL as record_hf.py does (hf_model.load) and returns the ids
    of every prompt, forward(name) -> (ids, logits float64 [T,V]), finish()
    and the provenance pieces."""
    import hf_model  # torch and transformers: only the HF sources need them
    import oracle_f64
    import tokenizers
    import torch
    from model_source import describe_source, hf_versions, weights_provenance

    hf_model.make_deterministic()
    source = describe_source(args.model)
    m = hf_model.load(args.model, source, args.dtype, log)
    model, cfg, tok, guard = m.model, m.cfg, m.tok, m.guard
    raw = None
    if source["kind"] == "hf":
        raw = tokenizers.Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))

    # Tokenise every text first: a mismatch with --tokens-from fails before
    # minutes of forward passes.
    ids_of, special_added = {}, False
    for name, text in prompts:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        if raw is not None:
            raw_ids = raw.encode(text, add_special_tokens=True).ids
            assert raw_ids == ids, f"{name}: AutoTokenizer ({ids}) and tokenizer.json ({raw_ids}) disagree"
        special_added |= ids != tok(text, add_special_tokens=False)["input_ids"]
        if forced is not None:
            want = [int(x) for x in forced[name]["tokens"]]
            if ids != want:
                raise UserError(f"prompt `{name}`: this tokenizer gives {ids}, --tokens-from has {want}")
        if any(t >= cfg.vocab_size for t in ids):
            raise UserError(f"prompt `{name}`: token ids {ids} exceed the vocabulary of {cfg.vocab_size}")
        ids_of[name] = ids

    def forward(name):
        ids = ids_of[name]
        x = torch.tensor([ids], dtype=torch.int64)
        pos = torch.arange(len(ids), dtype=torch.int64)[None]
        with torch.no_grad(), guard or contextlib.nullcontext():
            res = model(input_ids=x, position_ids=pos, use_cache=False, return_dict=True)
        lg = res.logits[0]
        forward.logits_dtype = str(lg.dtype).replace("torch.", "")
        assert lg.shape == (len(ids), cfg.vocab_size), lg.shape
        # float32 / bfloat16 / float16 -> float64 is exact.
        with oracle_f64.allowed(guard):
            out = lg.detach().to(torch.float64).numpy().copy()
        return ids, out
    forward.logits_dtype = None
    # The `memory:` line, logged once the file is written (goldens regen keeps it).
    forward.memory = lambda: oracle_f64.memory_line(m.model_bytes, m.f64_bytes)

    def stages(name):
        """Every canonical stage of the prompt's forward, tapped by the stage
        recorders' hooks (only for a prompt whose logits went non-finite:
        where did it start?), and their execution order."""
        import golden_io
        from hf_hooks import Recorder
        ids = ids_of[name]
        r = Recorder(model)
        r.guard, r.log, r.step, r.S = guard, (lambda msg: None), name, len(ids)
        r.install()
        try:
            with torch.no_grad(), guard or contextlib.nullcontext():
                res = model(input_ids=torch.tensor([ids], dtype=torch.int64),
                            position_ids=torch.arange(len(ids), dtype=torch.int64)[None], use_cache=False,
                            output_attentions=True, return_dict=True)
            for li, a in enumerate(res.attentions):
                r.put(f"blk.{li}.attn_probs", a)
        finally:
            r.remove()
        return r.rec, golden_io.all_stages(cfg.model_type, cfg.num_hidden_layers)
    forward.stages = stages

    def finish():
        if guard is not None:
            assert not guard.bad, f"float64 run: ops produced other float dtypes: {dict(guard.bad)}"

    prov = weights_provenance({"model_config": m.cfg_dict, "versions": hf_versions(pyyaml=yaml.__version__)},
                              source, hf_model_sha256=True)
    settings = {
        "engine": "hf transformers",
        "device": "cpu",
        "attn_implementation": "eager",
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": True,
        "tf32": False,
        "forward": "one pass over each prompt's tokens, positions 0..T-1, no KV cache",
    }
    if m.patched is not None:
        settings["float64"] = m.patched
    if args.dtype in ("bfloat16", "float16"):
        settings["cast"] = f"float32 weights cast to {args.dtype} after loading; HF's float32 islands kept"
    tokenization = {
        "tokenizer": "transformers AutoTokenizer of the " + ("GGUF" if source["kind"] == "gguf" else "folder"),
        "add_special_tokens": True,
        "chat_template": False,
        "special_tokens_added": special_added,
        "bos_token_id": tok.bos_token_id,
    }
    return ids_of, forward, finish, prov, settings, tokenization, cfg.vocab_size


# ---- llama.cpp ---------------------------------------------------------------------
def llamacpp_run(args, prompts, ids_of, model_config):
    import build_llamacpp
    import llamacpp_lib as lib

    with open(args.model, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{args.model} is not a GGUF file (no GGUF magic); --source llama.cpp runs a .gguf")
    lib_dir, binfo = build_llamacpp.ensure_built(os.path.abspath(args.cache_dir))
    src = build_llamacpp.source_dir(os.path.abspath(args.cache_dir))
    lc, g = lib.load_bindings(src, lib_dir)
    log(f"loading {args.model}")
    lib.silence(lc)
    model = lib.open_model(lc, args.model)
    if not model:
        raise UserError(f"libllama could not load {args.model}")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    arch, general_name, file_type = (lib.meta_str(lc, model, k) for k in
                                     ("general.architecture", "general.name", "general.file_type"))
    file_type = None if file_type is None else int(file_type)
    log(f"{arch} `{general_name}`, vocab {n_vocab}")

    # llama.cpp's own tokenisation of each text must be the ids fed. The one
    # difference tolerated (and recorded) is a BOS that llama.cpp adds where
    # the HF tokenizer adds none (a GGUF whose add_bos_token is true; not
    # Qwen2's): the text's own ids must still agree.
    def tokenize(text, add_special):
        b = text.encode("utf-8")
        n_max = len(b) + 16
        tbuf = (lc.llama_token * n_max)()
        nt = lc.llama_tokenize(vocab, b, len(b), tbuf, n_max, add_special, False)
        assert nt >= 0, f"llama_tokenize failed ({nt})"
        return [int(x) for x in tbuf[:nt]]
    mismatch, bos_added = {}, []
    for name, text in prompts:
        mine = tokenize(text, True)
        if mine == ids_of[name]:
            continue
        if mine[1:] == ids_of[name] and tokenize(text, False) == ids_of[name]:
            bos_added.append(name)
            continue
        mismatch[name] = mine
    if mismatch:
        name = next(iter(mismatch))
        raise UserError(f"prompt `{name}`: llama.cpp tokenises the text as {mismatch[name]}, the tokens fed are "
                        f"{ids_of[name]} ({len(mismatch)} prompt(s) differ)")
    if bos_added:
        log(f"warning: llama.cpp adds a BOS the tokens fed do not have ({len(bos_added)} prompt(s)); fed as given")
    for name, ids in ids_of.items():
        if len(ids) > N_CTX:
            raise UserError(f"prompt `{name}`: {len(ids)} tokens do not fit llama.cpp's context of {N_CTX}")
        if any(t >= n_vocab for t in ids):
            raise UserError(f"prompt `{name}`: token ids exceed llama.cpp's vocabulary of {n_vocab}")

    def forward(name, rec=None):
        """(ids, logits float64 [T,V]) of one prompt; `rec`: a NodeRecorder
        to observe the graph with (stages())."""
        ids = ids_of[name]
        cb = None if rec is None else lc.ggml_backend_sched_eval_callback(rec.callback)
        ctx = lc.llama_init_from_model(model, lib.context_params(lc, N_CTX, args.threads, args.kv_type, cb,
                                                                 swa_full=True))
        assert ctx, "context init failed"
        batch = lc.llama_batch_init(N_CTX, 0, 1)
        try:
            lib.fill_batch(batch, ids, range(len(ids)))  # every row: one distribution per position
            rc = lc.llama_decode(ctx, batch)
            assert rc == 0, f"{name}: llama_decode returned {rc}"
            lg = lib.all_logits(lc, ctx, len(ids), n_vocab)
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        assert lg.dtype == np.float32
        return ids, lg.astype(np.float64)
    forward.logits_dtype = "float32"

    def stages(name):
        """Every canonical stage of the prompt's graph (llamacpp_graph's
        map; needs the model config of --tokens-from/--oracle), for a prompt
        whose logits went non-finite, and their execution order."""
        if model_config is None:
            return None, None
        import golden_io
        import llamacpp_graph as graph
        rec = lib.NodeRecorder(g)
        ids, _ = forward(name, rec)
        dims = golden_io.model_dims(model_config)
        order = golden_io.all_stages(arch, dims[-1])
        st = graph.canonical(rec.nodes, name, arch, dims[-1], len(ids), len(ids), arch in graph.QK_PERMUTED, dims,
                             set(order), list(range(len(ids))), graph.attention_layout(model_config, arch, dims),
                             checked=set(), finite=False)
        return st, order
    forward.stages = stages

    def finish():
        lc.llama_model_free(model)

    gguf_sha = sha256_file(args.model)
    versions, build = lib.versions_and_build(binfo, pyyaml=yaml.__version__)
    prov = {
        "versions": versions,
        "build": build,
        "gguf_sha256": gguf_sha,
        "model": {"format": "gguf", "file": os.path.basename(args.model), "sha256": gguf_sha,
                  "general_name": general_name, "architecture": arch, "file_type": file_type},
    }
    if model_config is not None:
        prov["model_config"] = model_config
    settings = {
        "engine": "llama.cpp",
        "kv_cache_type": args.kv_type,
        "flash_attn": "disabled",
        "n_threads": args.threads,
        "n_ctx": N_CTX,
        "n_batch": N_CTX,
        "n_ubatch": N_CTX,
        "n_gpu_layers": 0,
        "swa_full": True,
        "logits": "all tokens",
        "forward": "one llama_decode batch per prompt, positions 0..T-1, a fresh context per prompt",
    }
    tokenization = {"tokenizer": "llama_tokenize (add_special, no parse_special)",
                    "matches_tokens_fed": not bos_added}
    if bos_added:
        tokenization["adds_bos_not_fed"] = bos_added
    # The arithmetic llama.cpp computes in: as the spec declares it (regen
    # passes it), else plain f32 for an unquantised GGUF.
    if args.arithmetic is not None:
        arith = args.arithmetic
    elif file_type in (0, 1):  # LLAMA_FTYPE_ALL_F32, MOSTLY_F16
        arith = {"storage": "f32", "activations": "exact", "kv": args.kv_type}
    else:
        raise UserError(f"{args.model} is quantised (file type {file_type}): give --arithmetic, the map the spec "
                        "declares under scaled.arithmetic for llama.cpp, e.g. "
                        "'{\"storage\":\"f32\",\"activations\":\"q8_k\",\"kv\":\"f16\"}'")
    if arith.get("kv", arith.get("storage")) != args.kv_type:
        raise UserError(f"--arithmetic says kv {arith.get('kv', arith.get('storage'))}, but --kv-type is "
                        f"{args.kv_type}")
    prov["arithmetic"] = arith
    return forward, finish, prov, settings, tokenization, n_vocab


# ---- main -----------------------------------------------------------------------------
def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="The module docstring (python -c 'import record_next_token; "
                                        "help(record_next_token)') and docs/recorders.md have the details.")
    ap.add_argument("model", help="HF model folder or .gguf (HF sources); the .gguf (llama.cpp)")
    ap.add_argument("out_file")
    ap.add_argument("--prompts", required=True, metavar="SET.yaml", help="the prompt set (goldens/prompt-sets/)")
    ap.add_argument("--source", required=True, choices=list(SOURCES),
                    help="the golden source: oracle (HF float64), hf, hf-bf16, hf-f16, llama.cpp")
    ap.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default=None,
                    help="HF dtype; must agree with --source (default: the source's)")
    ap.add_argument("--tokens-from", default=None, metavar="FILE",
                    help="feed this next-token golden's token ids (normally the `hf` one); required for llama.cpp "
                         "unless --oracle gives them")
    ap.add_argument("--oracle", default=None, metavar="FILE",
                    help="the oracle's next-token golden (every source but the oracle): stores `at_oracle`")
    ap.add_argument("--k", type=int, default=16, help="how many top ids to keep per position (default 16)")
    ap.add_argument("--kv-type", choices=["f32", "f16"], default="f32",
                    help="llama.cpp's K/V cache type (default f32; f16 is llama.cpp's own default)")
    ap.add_argument("--arithmetic", default=None, metavar="JSON",
                    help="llama.cpp: the arithmetic map the spec declares, e.g. "
                         "'{\"storage\":\"f32\",\"activations\":\"q8_k\",\"kv\":\"f16\"}' (recorded in provenance)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1)")
    ap.add_argument("--cache-dir", default=None, help="build_llamacpp.py's cache (llama.cpp only)")
    args = ap.parse_args()
    want = SOURCES[args.source]
    if want is None:
        if args.dtype is not None:
            ap.error("--dtype is for the HF sources; llama.cpp runs the GGUF as it is")
    else:
        if args.dtype is not None and args.dtype != want:
            ap.error(f"--source {args.source} is HF in {want}, not --dtype {args.dtype}")
        args.dtype = want
        for opt, given in (("--kv-type", args.kv_type != "f32"), ("--arithmetic", args.arithmetic is not None),
                           ("--threads", args.threads != 1), ("--cache-dir", args.cache_dir is not None)):
            if given:
                ap.error(f"{opt} is for --source llama.cpp")
    if args.k < 1:
        ap.error(f"--k {args.k}: must be at least 1")
    if args.threads < 1:
        ap.error(f"--threads {args.threads}: must be at least 1")
    if args.source == "oracle":
        if args.oracle is not None:
            ap.error("--oracle is the oracle's own file: leave it out for --source oracle")
    elif args.oracle is None:
        ap.error(f"--source {args.source} needs --oracle FILE (the oracle's next-token golden of the same set)")
    if args.arithmetic is not None:
        try:
            a = json.loads(args.arithmetic)
        except json.JSONDecodeError as e:
            ap.error(f"--arithmetic {args.arithmetic!r}: not JSON ({e})")
        if not isinstance(a, dict) or "storage" not in a or set(a) - {"storage", "activations", "kv", "act"}:
            ap.error(f"--arithmetic {args.arithmetic!r}: expected a map with `storage` and optionally "
                     "`activations`, `kv`, `act`")
        args.arithmetic = a
    if args.cache_dir is None and want is None:
        import build_llamacpp
        args.cache_dir = build_llamacpp.DEFAULT_CACHE
    if not os.path.exists(args.model):
        ap.error(f"model {args.model} does not exist")
    if want is None and not (os.path.isfile(args.model) and args.model.endswith(".gguf")):
        ap.error(f"--source llama.cpp runs a .gguf file; {args.model} is not one")
    if os.path.isdir(args.out_file):
        ap.error(f"{args.out_file} is a folder")
    return ap, args


def main():
    ap, args = parse_args()
    try:
        return record(args)
    except UserError as e:
        ap.exit(2, f"{TOOL}: error: {e}\n")


def record(args):
    prompts, set_sha = read_prompt_set(args.prompts)
    names = [n for n, _ in prompts]
    forced = tf_prov = oracle = o_prov = None
    if args.tokens_from is not None:
        tf_prov, forced = read_golden(args.tokens_from, "--tokens-from", names, set_sha)
    if args.oracle is not None:
        o_prov, oracle = read_golden(args.oracle, "--oracle", names, set_sha)
        if o_prov.get("source") != "oracle":
            raise UserError(f"--oracle {args.oracle}: its source is {o_prov.get('source')!r}, not `oracle`")
        if o_prov.get("k") != args.k:
            raise UserError(f"--oracle {args.oracle} keeps K = {o_prov.get('k')}, this run --k {args.k}: "
                            "use the same K")
    log(f"{len(prompts)} prompts from {args.prompts}; source {args.source}, K {args.k}")

    if SOURCES[args.source] is None:
        src = forced if forced is not None else oracle
        if src is None:
            raise UserError("--source llama.cpp is fed the ids of --tokens-from (or --oracle): give one")
        ids_of = {n: [int(x) for x in src[n]["tokens"]] for n in names}
        cfg = (tf_prov or o_prov).get("model_config")
        forward, finish, prov, settings, tokenization, n_vocab = llamacpp_run(args, prompts, ids_of, cfg)
    else:
        ids_of, forward, finish, prov, settings, tokenization, n_vocab = hf_run(args, prompts, forced)
    if args.k > n_vocab:
        raise UserError(f"--k {args.k} exceeds the vocabulary of {n_vocab}")
    if oracle is not None:
        gone = sorted(left_out(o_prov))
        if gone:
            raise UserError(f"--oracle {args.oracle} left out prompt(s) {gone} (its logits went non-finite): there "
                            "is nothing to measure this source against there")
        for n in names:
            want = [int(x) for x in oracle[n]["tokens"]]
            if ids_of[n] != want:
                raise UserError(f"prompt `{n}`: the tokens fed {ids_of[n]} are not the oracle's {want}")
        if o_prov.get("n_vocab") != n_vocab:
            raise UserError(f"--oracle {args.oracle} has a vocabulary of {o_prov.get('n_vocab')}, this model "
                            f"{n_vocab}")

    out, skipped = {}, []
    for i, (name, _) in enumerate(prompts):
        log(f"{name}: {len(ids_of[name])} tokens ({i + 1}/{len(prompts)})")
        ids, logits = forward(name)
        if not np.isfinite(logits).all():
            # An overflow is data: the prompt is left out, the provenance says
            # where its forward went non-finite.
            skipped.append(overflowed(name, ids, logits, forward.stages, oracle))
            log(f"{name}: non-finite logits from position {skipped[-1]['position']} on (first at "
                f"{skipped[-1]['stage']}): left out")
            continue
        s = distribution_summary(logits, args.k, None if oracle is None else oracle[name]["top_ids"])
        out[f"{name}/tokens"] = np.array(ids, dtype=np.int64)
        for k, v in s.items():
            out[f"{name}/{k}"] = v
    finish()
    written = [n for n in names if n not in {e["prompt"] for e in skipped}]

    prov.update({
        "source": args.source,
        "recorder": RECORDER,
        "k": args.k,
        "n_vocab": n_vocab,
        "prompt_set": {"path": set_path_for_provenance(args.prompts), "sha256": set_sha},
        "prompts": written,
        "token_counts": {n: len(ids_of[n]) for n in written},
        "settings": settings,
        "tokenization": tokenization,
        "logits_dtype": forward.logits_dtype,
        "logprobs": "log_softmax over the whole vocabulary in float64 (numpy: x - max, log of the sum of exp) "
                    "of the logits upcast exactly to float64; top ids by descending log-probability, ties to "
                    "the lower id",
        "teacher_forcing": "every position of one forward pass over the text's own tokens",
    })
    if SOURCES[args.source] is not None:
        prov["dtype"] = args.dtype
    if args.tokens_from is not None:
        prov["tokens_from"] = {"source": tf_prov.get("source"), "sha256": sha256_file(args.tokens_from)}
    if args.oracle is not None:
        prov["oracle"] = {"sha256": sha256_file(args.oracle)}
    if skipped:
        prov["overflow"] = {"dtype": args.dtype or "float32", "prompts": skipped}
    golden_io.write_golden(out, golden_io.metadata(prov, FORMAT), args.out_file, log)
    size = os.path.getsize(args.out_file)
    if hasattr(forward, "memory"):
        log(forward.memory())
    summary = {"out": args.out_file, "source": args.source, "bytes": size, "sha256": sha256_file(args.out_file),
               "tokens": sum(len(ids_of[n]) for n in written), "left_out": [e["prompt"] for e in skipped]}
    if oracle is not None:
        top1 = sum(int((out[f"{n}/top_ids"][:, 0] == oracle[n]["top_ids"][:, 0]).sum()) for n in written)
        summary["top1_agreement_with_oracle"] = f"{top1}/{summary['tokens']}"
    print(json.dumps(summary))
    if skipped:
        print(f"overflow: {len(skipped)} of {len(names)} prompt(s) left out ({args.dtype or 'float32'}): " + "; ".join(
            f"{e['prompt']} from position {e['position']} (first at {e['stage']}, row {e['row']}: {e['nonfinite']} "
            f"non-finite), oracle_max_abs {e['oracle_max_abs']}" for e in skipped), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
