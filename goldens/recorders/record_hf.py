#!/usr/bin/env python3
"""Record golden tensors for every canonical stage with HF transformers.

usage: record_hf.py MODEL OUT_FILE [--prompt TEXT [--chat] | --prompt-tokens ID,...] [--decode-steps N]
                    [--steps STEP,...] [--stages PATTERN,...] [--logits all|last]
                    [--stages-at STEP=PATTERN,...] [--rows ROW,...] [--aux STEP=PATTERN,...]
                    [--dtype float32|float64|bfloat16|float16] [--oracle ORACLE]
                    [--tokens-from GOLDEN] [--sample-probs TEMPERATURE,TOP_K,TOP_P]
                    [--config-override JSON]

MODEL is an HF folder (config.json, tokenizer files and either one
`model.safetensors` or a sharded `model.safetensors.index.json` with its
shards) or a `.gguf` file, which transformers' own GGUF loader dequantises to
float32 (tokenizer and config from the GGUF too; model_source.py,
hf_model.py). Runs it (PyTorch, CPU, float32, eager attention, one thread,
deterministic algorithms, no TF32) on the prompt as one prefill pass
followed by N greedy decode steps that reuse the KV cache, and writes the
canonical stages of the steps into ONE safetensors file, OUT_FILE. The keys,
stages and layouts, and how each stage is tapped: hf_hooks.py.

--chat renders the prompt with the tokenizer's chat template as one user
message with add_generation_prompt=True. --prompt-tokens ID,... feeds those
token ids exactly as given, untokenised (provenance `prompt.given: tokens`).
--steps, --stages and --logits last store a subset (a real model's full
goldens are gigabytes): every step still runs, `tokens` and `positions` are
stored for every step (teacher forcing needs them), and the provenance says
what was stored (`record`). --stages-at STEP=PATTERN[,PATTERN] (repeatable)
stores those stages at that one step as well (provenance `record.stages_at:
{STEP: [PATTERN, ...]}`): e.g. the [H,T,S] attn_scores of a long prompt's
decode step, whose prefill scores would not fit in a committed file.
--rows 0,-1 keeps those token rows of every stored stage (provenance
`record.rows: {STEP: [ROW, ...]}`): every stage of several layers of a real
model then fits a committed file. --aux STEP=PATTERN[,PATTERN] (repeatable,
parsed as --stages-at) stores those stages at that step with EVERY token
row, whatever --rows and --logits say, even when --stages stores them too
(the stored tensor then holds every row), and at a step --steps leaves out
(then those stages only): auxiliary tensors the scaled policy reads to
compute error floors, never checked themselves (provenance `record.aux:
{STEP: [PATTERN, ...]}`, steps in step order, patterns as given).
--aux-rows STEP=PATTERN[,PATTERN] is the same on the rows --rows keeps (a
recorded stage's inputs, read on the rows it is judged on; `record.aux_rows`).

A forward that overflows is data (overflow.py): every canonical stage of
every step is watched, in execution order, and at the first non-finite
(step, stage) the recording stops storing. The golden keeps every tensor
computed before that point and the tokens and positions of every step (with
--tokens-from every step's; without it a step after the overflow has no
token to be fed, so it is not run and not in the golden); provenance
`overflow` says where ({step, stage, dtype, nonfinite, max_abs_finite_before,
oracle_max_abs}: the largest |x| of --oracle's tensor at that (step, stage),
null without one or where it holds none) and `overflow_skipped` what was
not stored or checked. `greedy_ids` keeps the picks of the steps whose
logits were finite. The checks that compare data (the attention tap's
recomputation, the cache cross-checks, the tied-pair checks) run only on
what came before the overflow. Exit 0, and one line on stderr starting
`overflow: `.

--dtype float64 records an f64 ORACLE (oracle_f64.py): every operation of
the forward runs in float64 on the float32 weights widened exactly (a GGUF's
dequantised ones included), streamed layer by layer (the peak is within 2x
the float32 model, printed as the `memory:` line). The three places of HF's
code that compute in float32 whatever the model's dtype -- the RoPE cos/sin
tables, RMSNorm (q_norm/k_norm too; Gemma 3's 1 + w variant) and the eager
attention softmax -- are replaced for this run by the same formulas in
float64 (Gemma 3's RoPE: one float64 table per layer type, asserted against
HF's float32 tables). The attention mask is built in the embeddings' dtype
(min float64 for masked entries), which the softmax turns into exact 0. A
dispatch-level guard asserts that no operation of any forward produced a
tensor of another floating dtype. Each stored tensor is the float64 value
rounded ONCE to float32 (a relative error of at most u/2 = 2^-25, far below
the float32 arithmetic error the oracle measures). Provenance: as a float32
recording but `"dtype": "float64"` (`source` stays `hf`). The default,
float32, is the HF golden.

--dtype bfloat16 / float16 records a 16-bit reference, as a GPU user runs
the model: the same float32 weights (a GGUF's dequantised ones) cast to the
dtype after loading, and HF's own code as it is, float32 islands included
(RMSNorm and the attention softmax compute in float32 and cast back, the
RoPE tables are float32 cast to the dtype). Provenance `"dtype"` says which:
touchstone judges a 16-bit engine against the references of its dtype.

--tokens-from GOLDEN feeds exactly that golden's token ids (its
`prefill/tokens`, then `decodeN/tokens` one by one) instead of this run's own
greedy picks: a 16-bit reference whose greedy pick differs from the f32
golden's at a near-tie is still fed the same tokens (teacher forcing), so
every reference and the oracle see identical inputs. The prompt and the
decode steps are the golden's (--prompt, --chat and --decode-steps must be
left out); `greedy_ids` still records this run's own picks, and provenance
`tokens_from` the golden's sha256.

--sample-probs TEMPERATURE,TOP_K,TOP_P (e.g. 0.7,40,0.9; TOP_K 0 and TOP_P
1.0 switch that filter off) adds the stage `sample_probs` [1,V] at every
step: the last row of the logits through HF's own logits processors, in the
order and under the conditions of GenerationMixin._get_logits_processor of
the pinned transformers (TemperatureLogitsWarper if the temperature is not
1.0, then TopKLogitsWarper if TOP_K is not 0, then TopPLogitsWarper if
TOP_P < 1.0; min_tokens_to_keep 1; the list is built by that very method and
its classes asserted), then softmax in the logits' dtype (float32; float64
with --dtype float64). Tokens the filters remove are exactly 0. Provenance:
`sampling: {temperature, top_k, top_p}` and `sampling_processors` (the class
names in order). The tokens fed stay the greedy ones.

Scaled RoPE (linear, dynamic, yarn, longrope, llama3; rope_scaling_f64.py):
HF computes the tables in float32, and the float64 oracle computes the same
formulas in float64. Each step is one forward on the model as loaded
(prefill, then one token per decode step), so a per-forward scaling
(dynamic, longrope: the table of seq_len = max(position_ids) + 1, cached
keys never re-rotated) records per step the table HF picks for it; after
every step the table is asserted against the rule (float32: HF's own vs
float64 RopeF64; float64: against a float32 HF rotary module fed the same
positions). Provenance `rope`: the scaling, and per step its seq_len, table
and attention scaling; the cross-checks start from a fresh RoPE state.

--config-override JSON (a spec's `config:`, as `touchstone goldens regen`
passes it) merges that mapping into the model's HF config before the model
is built, as touchstone's engines do (config_override.py: the RoPE keys
update the RoPE parameters the config has; a GGUF takes only rope_scaling,
rope_parameters and max_position_embeddings), and asserts the model carries
it (the rotary module's scaling included; the float64 oracle's tables are
then rope_scaling_f64's for it). Provenance: `config_override`, the mapping
as given, and `model_config`, the merged config.

With a subset (--steps, --stages, --logits last, --rows) the hooks capture
lean (hf_hooks.py): a stage not stored is only checked for finiteness, and
the attention probabilities are taken one layer at a time, so a long
prompt never holds every layer's [H,T,S]. The stored tensors are the same.

Sliding-window models (Gemma 3, Qwen2 with use_sliding_window): the cache keeps every position of every
layer (the canonical [H,T,S]), HF's mask still applies the window (asserted
by the tap), and the logits are cross-checked with HF's own trimmed cache
(hf_crosschecks.py; provenance `sliding_cache_vs_full_cache_max_abs_diff`),
as with the one-pass recompute (`cache_vs_full_max_abs_diff`).

Mixture-of-experts models (moe_families.py) run transformers' eager experts; their routing stages and
the float64 routers of the oracle: moe_hooks.py. Provenance `moe`: layout, the smallest top-k margin per
layer, the prefill's expert counts.

If the LM head's rows are equal in pairs (row 2j+1 == row 2j bit for bit:
phi3-tiny, see make_model.py), every logit pair must tie bit for bit and
every greedy id (argmax: the lowest index of a tie) must be even; asserted.

`__metadata__` holds `format` = touchstone-golden/1 and `provenance`, a
compact sorted-key JSON string (hf_model.build_provenance). The output
contains nothing that varies between runs or machines (no time, host or
path), so a rerun with the pinned packages is byte-for-byte identical.
"""
import argparse
import contextlib
import json
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import tokenizers
import torch
import transformers
from transformers import DynamicCache

# Import the sibling scripts without leaving a __pycache__ in the repository.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_io  # noqa: E402  (shared with record_llamacpp.py)
from golden_io import progress, sha256_file  # noqa: E402
import hf_model  # noqa: E402  (loading, determinism, provenance: shared with the other HF recorders)
import config_override  # noqa: E402  (a spec's `config:` mapping)
import oracle_f64  # noqa: E402
import rope_scaling_f64  # noqa: E402  (a scaled RoPE's table per step)
import moe_hooks  # noqa: E402  (a mixture-of-experts model's routing)
import overflow  # noqa: E402  (a forward that overflows is data)
from hf_crosschecks import cache_cross_check, run_sliding, sliding_cross_check  # noqa: E402
from hf_hooks import (Recorder, all_finite, attention_rows, attention_summary, config_dims,  # noqa: E402
                      layer_windows)
from model_source import describe_source  # noqa: E402

RECORDER = "goldens/recorders/record_hf.py"
DEFAULT_PROMPT = "Golden tensors check every stage."


def log(msg):
    progress("record_hf.py", msg)


def parse_args():
    """The arguments, checked; adds sampling, extra, forced, given_ids,
    all_steps, keep_steps and rows (the parsed --rows) to them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="HF model folder (single or sharded safetensors) or a .gguf file")
    ap.add_argument("out_file")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--prompt-tokens", default=None, metavar="ID,...",
                    help="feed these token ids as the prompt, exactly as given (no tokenizer)")
    ap.add_argument("--chat", action="store_true",
                    help="render the prompt with the tokenizer's chat template (one user message, "
                         "add_generation_prompt=True)")
    ap.add_argument("--decode-steps", type=int, default=3)
    ap.add_argument("--steps", default=None,
                    help="comma-separated steps to store (prefill,decode1,...; default all); every step still runs")
    ap.add_argument("--stages", default="*",
                    help="comma-separated stage patterns to store, as in specs (`blk.*.q`, `blk.0.*`; default `*`)")
    ap.add_argument("--logits", choices=["all", "last"], default="all",
                    help="`last` stores only the last row of each step's logits, shape [1,V]")
    ap.add_argument("--stages-at", action="append", default=[], metavar="STEP=PATTERN[,PATTERN]",
                    help="also store these stages at this one step (repeatable)")
    ap.add_argument("--rows", default=None, metavar="ROW[,ROW]",
                    help="keep only these token rows (negative from the end, e.g. 0,-1) of every stage with a "
                         "token axis (tokens/positions stay whole; --logits last keeps the last row)")
    ap.add_argument("--aux", action="append", default=[], metavar="STEP=PATTERN[,PATTERN]",
                    help="also store these stages at this step with every token row (auxiliary tensors for the "
                         "error floors; repeatable)")
    ap.add_argument("--aux-rows", action="append", default=[], metavar="STEP=PATTERN[,PATTERN]",
                    help="also store these stages at this step on the --rows rows (auxiliary; repeatable)")
    ap.add_argument("--oracle", default=None, metavar="ORACLE",
                    help="the float64 oracle's golden: an overflow's provenance gives its largest |x| there")
    ap.add_argument("--dtype", choices=list(hf_model.DTYPES), default="float32",
                    help="float64: the f64 oracle (every op in float64, stored rounded to float32); "
                         "bfloat16/float16: a 16-bit reference (weights cast, HF's own float32 islands)")
    ap.add_argument("--tokens-from", default=None, metavar="GOLDEN",
                    help="feed exactly this golden's token ids at every step (teacher forcing) instead of "
                         "this run's own greedy picks; its prompt and decode steps are used")
    ap.add_argument("--sample-probs", default=None, metavar="TEMPERATURE,TOP_K,TOP_P",
                    help="store `sample_probs` [1,V] at every step: HF's temperature/top-k/top-p "
                         "processors on the last logits row, then softmax (TOP_K 0, TOP_P 1.0: off)")
    ap.add_argument("--config-override", default=None, metavar="JSON",
                    help="merge this mapping into the model's HF config (a spec's `config:`; config_override.py)")
    args = ap.parse_args()
    args.override = None if args.config_override is None else config_override.parse(args.config_override,
                                                                                     "record_hf.py")
    args.sampling = None
    if args.sample_probs is not None:
        try:
            t_, k_, p_ = args.sample_probs.split(",")
            args.sampling = {"temperature": float(t_), "top_k": int(k_), "top_p": float(p_)}
        except ValueError:
            ap.error(f"--sample-probs {args.sample_probs!r}: expected TEMPERATURE,TOP_K,TOP_P, e.g. 0.7,40,0.9")
        s = args.sampling
        if not (s["temperature"] > 0 and s["top_k"] >= 0 and 0 < s["top_p"] <= 1):
            ap.error(f"--sample-probs {args.sample_probs!r}: need TEMPERATURE > 0, TOP_K >= 0, 0 < TOP_P <= 1")
    args.extra = ["sample_probs"] if args.sampling is not None else []
    args.forced = None
    if args.tokens_from is not None:
        if args.prompt != DEFAULT_PROMPT or args.chat:
            ap.error("--tokens-from takes the prompt from the golden: leave out --prompt and --chat")
        args.forced = golden_io.read_tokens(args.tokens_from, ap)
        n_forced = len(args.forced["steps"]) - 1
        given = [a for a in sys.argv[1:] if a == "--decode-steps" or a.startswith("--decode-steps=")]
        if given and args.decode_steps != n_forced:
            ap.error(f"--decode-steps {args.decode_steps}, but --tokens-from {args.tokens_from} recorded "
                     f"{n_forced}: leave it out")
        args.decode_steps = n_forced
    if args.decode_steps < 0:
        ap.error("--decode-steps must be >= 0")
    if not args.prompt:
        ap.error("--prompt must not be empty")
    args.given_ids = None
    if args.prompt_tokens is not None:
        if args.prompt != DEFAULT_PROMPT or args.chat or args.tokens_from is not None:
            ap.error("--prompt-tokens is the whole prompt: leave out --prompt, --chat and --tokens-from")
        try:
            args.given_ids = [int(t) for t in args.prompt_tokens.split(",")]
        except ValueError:
            ap.error(f"--prompt-tokens {args.prompt_tokens!r}: expected comma-separated token ids, e.g. 1,2,3")
        if len(args.given_ids) < 2 or min(args.given_ids) < 0:
            ap.error(f"--prompt-tokens {args.prompt_tokens!r}: need at least 2 ids, none negative")
    args.all_steps = ["prefill"] + [f"decode{i}" for i in range(1, args.decode_steps + 1)]
    try:
        args.keep_steps = args.all_steps if args.steps is None else golden_io.parse_steps(args.steps,
                                                                                          args.decode_steps)
        args.row_list = None if args.rows is None else golden_io.parse_rows(args.rows)
    except golden_io.SelectionError as e:
        ap.error(str(e))
    if os.path.exists(args.out_file) and os.path.isdir(args.out_file):
        ap.error(f"{args.out_file} is a folder")
    if args.oracle is not None:
        overflow.check_oracle(args.oracle)
    return ap, args


def parse_selection(ap, args, model_type, n_layers, layout=None):
    """What to store (golden_io.select_step's `sel`): patterns, keep,
    stages_at(_sets), aux(_sets), keep_steps, logits, rows. `layout`: a MoE model's golden_io.moe_layout."""
    sel = types.SimpleNamespace(keep_steps=args.keep_steps, logits=args.logits, rows=args.row_list)
    try:
        sel.patterns, sel.keep = golden_io.parse_stages(args.stages, model_type, n_layers, args.extra, layout=layout)
        sel.stages_at, sel.stages_at_sets = golden_io.parse_stages_at(args.stages_at, model_type, n_layers,
                                                                      args.decode_steps, args.extra, layout=layout)
        sel.aux, sel.aux_sets = golden_io.parse_stages_at(args.aux, model_type, n_layers, args.decode_steps,
                                                          args.extra, what="--aux", layout=layout)
        sel.aux_rows, sel.aux_rows_sets = golden_io.parse_stages_at(args.aux_rows, model_type, n_layers,
                                                                    args.decode_steps, args.extra, what="--aux-rows",
                                                                    layout=layout)
    except golden_io.SelectionError as e:
        ap.error(str(e))
    return sel


def choose_prompt(args, tok, cfg, source):
    """(prompt ids, provenance `prompt`): the golden's (--tokens-from), the
    ids given (--prompt-tokens), the chat template's rendering (--chat) or
    the text as it is."""
    forced = args.forced
    if forced is not None:
        prompt = dict(forced["prompt"])
        prompt_ids = forced["tokens"]["prefill"]
        text = prompt.get("rendered", prompt.get("text"))
        assert prompt["token_ids"] == prompt_ids
    elif args.given_ids is not None:
        too_big = [t for t in args.given_ids if t >= cfg.vocab_size]
        if too_big:
            sys.exit(f"record_hf.py: --prompt-tokens: ids {too_big} are outside the vocabulary of "
                     f"{cfg.vocab_size} tokens")
        prompt_ids = args.given_ids
        text = None
        prompt = {"given": "tokens", "token_ids": prompt_ids}
    elif args.chat:
        if not getattr(tok, "chat_template", None):
            sys.exit(f"record_hf.py: --chat, but the tokenizer of {args.model} has no chat template")
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                       add_generation_prompt=True)
        # The template writes any BOS itself.
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        prompt = {"text": args.prompt, "chat": True, "rendered": text, "token_ids": prompt_ids}
    else:
        text = args.prompt
        prompt_ids = tok(text, add_special_tokens=True)["input_ids"]
        prompt = {"text": args.prompt, "token_ids": prompt_ids}
    if source["kind"] == "hf" and forced is None and args.given_ids is None:
        # The tokenizer.json in the folder is what engines read; make sure the
        # transformers wrapper did not tokenize differently from it.
        raw = tokenizers.Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
        raw_ids = raw.encode(text, add_special_tokens=not args.chat).ids
        assert raw_ids == prompt_ids, f"AutoTokenizer ({prompt_ids}) and tokenizer.json ({raw_ids}) disagree"
    assert len(prompt_ids) >= 2, "prompt must have at least 2 tokens"
    return prompt_ids, prompt


def record_steps(args, m, r, prompt_ids, sel, procs, pair_ties, watch):
    """Runs the prefill and every decode step with the hooks `r` installed,
    `watch` (overflow.Watch) looking at every stage; returns what was stored
    and seen (a namespace; `clean`: the steps before any overflow)."""
    model, cfg, guard = m.model, m.cfg, m.guard
    n_layers = cfg.num_hidden_layers
    run = types.SimpleNamespace(out={}, steps=[], greedy_ids=[], att_rows={"prefill": [], "decode": []},
                                prefill_row_max=[], logit_absmax=0.0, step_tokens={}, step_last_logits=[],
                                fed=list(prompt_ids), clean=[], not_run=[], rope_passes={})
    out = run.out
    x = torch.tensor([prompt_ids], dtype=torch.int64)
    windows = layer_windows(cfg)
    # A sliding-window model (Gemma 3, Qwen2's swa) would get a DynamicCache built from its
    # config, whose sliding layers keep only the last window - 1 positions:
    # attn_scores/attn_probs of those layers would be narrower than S in
    # decode steps. The canonical [H,T,S] has every position, so the cache
    # here is a plain DynamicCache (no config: every layer keeps every
    # position, asserted after each step); HF's sliding-window mask still
    # removes the keys outside the window (asserted in the attention tap),
    # and the logits agree with HF's own trimmed cache (checked below).
    past, pos = (DynamicCache() if run_sliding(cfg) else None), 0
    dims = config_dims(cfg)
    order = golden_io.all_stages(cfg.model_type, n_layers, args.extra, golden_io.moe_layout(cfg))
    expected = order + ["tokens", "positions"]
    forced = args.forced
    # A subset is captured lean (hf_hooks.Recorder.lean): only what is stored is held.
    lean = args.steps is not None or args.stages != "*" or args.logits != "all" or args.row_list is not None
    all_steps = ["prefill"] + [f"decode{i}" for i in range(1, args.decode_steps + 1)]
    with torch.no_grad():
        for si, step in enumerate(all_steps):
            T = x.shape[1]
            positions = torch.arange(pos, pos + T, dtype=torch.int64)
            if watch.found is not None:
                # After an overflow nothing is run or stored but the tokens
                # fed, and those only when the golden of --tokens-from gives them.
                if forced is None:
                    run.not_run = all_steps[si:]
                    break
                run.steps.append(step)
                out[f"{step}/tokens"] = x[0].numpy().astype(np.int64)
                out[f"{step}/positions"] = positions.numpy()
                run.step_tokens[step] = T
                pos += T
                if si < args.decode_steps:
                    x = torch.tensor([[forced["tokens"][f"decode{si + 1}"][0]]], dtype=torch.int64)
                continue
            run.steps.append(step)
            r.rec.clear()
            r.standins.clear()
            r.step = step
            if lean:
                r.lean = lambda k, step=step: k in sel.aux_sets.get(step, ()) or golden_io.stored(
                    step, k, sel.keep_steps, sel.keep, sel.stages_at_sets, sel.aux_rows_sets)
                r.last_row = {"logits"} if sel.logits == "last" and "logits" not in sel.aux_sets.get(step, ()) \
                    else set()
            log(f"{step}: {T} token(s) at position {pos}")
            r.S = pos + T
            with guard or contextlib.nullcontext():
                res = model(input_ids=x, position_ids=positions[None], past_key_values=past,
                            use_cache=True, output_attentions=not lean, return_dict=True)
            assert past is None or res.past_key_values is past
            past = res.past_key_values
            if m.rope_watch is not None:
                # A scaled RoPE: the table this forward used (seq_len =
                # max(position_ids) + 1 = pos + T) is the one HF's
                # per-forward rule gives (asserted in the watch).
                run.rope_passes[step] = m.rope_watch.after(step, pos + T)
            if run_sliding(cfg):
                lens = [layer.keys.shape[-2] for layer in past.layers]
                assert len(lens) == n_layers and lens == [pos + T] * n_layers and not any(past.is_sliding), \
                    f"{step}: the cache holds {lens} positions per layer, expected all {pos + T}"
            logits_finite = all_finite(res.logits)
            if pair_ties and logits_finite:
                lg = res.logits[0]
                assert torch.equal(lg[:, 0::2], lg[:, 1::2]), f"{step}: logit pairs do not tie exactly"
            if procs is not None:
                with guard or contextlib.nullcontext():
                    scores = procs(torch.tensor([run.fed], dtype=torch.int64), res.logits[:, -1, :])
                    # As GenerationMixin._sample: softmax of the processed scores.
                    probs = torch.nn.functional.softmax(scores, dim=-1)
                r.put("sample_probs", probs[None])  # [1,1,V] -> [1,V]
                sp = r.rec["sample_probs"]
                if np.isfinite(sp).all():
                    assert abs(float(sp.astype(np.float64).sum()) - 1.0) < 1e-5, sp.sum()
                    if args.sampling["top_k"]:
                        assert (sp > 0).sum() <= args.sampling["top_k"] or pair_ties
            if not lean:  # (lean: the attention tap put them, layer by layer)
                assert len(res.attentions) == n_layers
                for li, a in enumerate(res.attentions):
                    r.put(f"blk.{li}.attn_probs", a)  # [1,H,T,S] -> [H,T,S]
            # The hooked logits must be what the model returned.
            if "logits" not in r.standins:
                n = r.rec["logits"].shape[0]
                assert np.array_equal(r.rec["logits"], res.logits[0, -n:].to(torch.float32).numpy(), equal_nan=True)
            r.rec["tokens"] = x[0].numpy().astype(np.int64)
            r.rec["positions"] = positions.numpy()
            assert sorted(r.rec) == sorted(expected), sorted(set(r.rec) ^ set(expected))
            S = pos + T
            for k, v in r.rec.items():
                want = golden_io.expected_shape(k, T, S, dims)
                want = (1,) + tuple(want[1:]) if k in r.last_row else want
                assert k in r.standins or v.shape == want, f"{step}/{k}: shape {v.shape}"
            if watch.scan(step, r.rec, order):
                run.clean.append(step)
                for li in range(n_layers):
                    probs = r.rec[f"blk.{li}.attn_probs"]
                    if f"blk.{li}.attn_probs" in r.standins:
                        continue  # lean: not stored, not held
                    run.att_rows["prefill" if si == 0 else "decode"] += attention_rows(
                        probs, positions.numpy(), windows[li])
                    if si == 0:
                        run.prefill_row_max.append(probs.max(axis=-1).mean())
                lg = r.rec["logits"]  # (lean: the STANDIN, empty, when not stored)
                run.logit_absmax = max(run.logit_absmax, float(np.abs(lg).max()) if lg.size else
                                       max(float(row.abs().max()) for row in res.logits[0]))
            # tokens/positions of every step: teacher forcing needs them.
            kept = golden_io.select_step(step, r.rec, sel, T, lambda k: watch.keeps(step, k))
            out.update({f"{step}/{k}": v for k, v in kept.items()})
            run.step_tokens[step] = T
            pos += T
            nxt = None
            if logits_finite:
                nxt = int(res.logits[0, -1].argmax())
                if pair_ties:
                    assert nxt % 2 == 0, f"{step}: greedy id {nxt} is odd despite the tied pairs"
                run.greedy_ids.append(nxt)
                run.step_last_logits.append(res.logits[0, -1].to(torch.float64).numpy().copy())
                log(f"{step}: greedy token {nxt}")
            feed = nxt
            if forced is not None and si < args.decode_steps:
                feed = forced["tokens"][f"decode{si + 1}"][0]
                if feed != nxt:
                    log(f"{step}: {'non-finite logits' if nxt is None else f'greedy token {nxt}'}; fed the "
                        f"golden's {feed} (teacher forcing)")
            elif feed is None:
                run.not_run = all_steps[si + 1:]  # no token to feed them
                break
            run.fed.append(feed)
            x = torch.tensor([[feed]], dtype=torch.int64)
            res = None  # the prefill's [T,V] logits are not held through the decode steps
    # A decode step feeds one token, run or not (record.rows names every step).
    run.step_tokens.update({s: 1 for s in run.not_run})
    return run


def main():
    ap, args = parse_args()
    hf_model.make_deterministic()
    transformers.utils.logging.disable_progress_bar()

    source = describe_source(args.model)
    if source["kind"] == "hf":
        with open(os.path.join(args.model, "config.json")) as f:
            cfg_file = json.load(f)
        # Validate the stage patterns before the (slow) weight load.
        parse_selection(ap, args, cfg_file.get("model_type"), cfg_file["num_hidden_layers"],
                        golden_io.moe_layout(cfg_file))
    elif args.override is not None:
        config_override.check_keys(args.override, True, "record_hf.py")
    m = hf_model.load(args.model, source, args.dtype, log, args.override)
    model, cfg, tok = m.model, m.cfg, m.tok
    n_layers = cfg.num_hidden_layers
    sel = parse_selection(ap, args, cfg.model_type, n_layers, golden_io.moe_layout(cfg))
    # An LM head whose rows are equal in pairs (phi3-tiny): every logit pair
    # must tie bit for bit, and argmax (lowest index) must pick even ids.
    W = model.lm_head.weight
    pair_ties = W.shape[0] % 2 == 0 and torch.equal(W[0::2], W[1::2])
    if pair_ties:
        log("the LM head's rows are equal in pairs: checking exact logit ties and even greedy ids")
    procs, sampling = None, None
    if args.sampling is not None:
        procs, sampling = hf_model.sampling_processors(model, args.sampling)
        log(f"sampling processors: {sampling['processors']}")
    log(f"loaded: {cfg.model_type}, {n_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    prompt_ids, prompt = choose_prompt(args, tok, cfg, source)
    log(f"prompt: {len(prompt_ids)} tokens; {args.decode_steps} decode step(s)")

    # A scaled RoPE (linear, dynamic, yarn, longrope, llama3): the table of
    # every step, from the fresh model's state (rope_scaling_f64.py).
    m.rope_watch = rope_scaling_f64.watch(model)
    r = Recorder(model)
    r.guard = m.guard
    r.install()
    watch = overflow.Watch(args.dtype, args.oracle)
    try:
        run = record_steps(args, m, r, prompt_ids, sel, procs, pair_ties, watch)
    finally:
        r.remove()
    # Each cross-check starts from a fresh model's RoPE state (a per-pass
    # scaling's table depends on the forwards before).
    fresh = m.rope_watch.reset if m.rope_watch is not None else (lambda: None)
    fresh()
    sliding_vs_full_cache = sliding_cross_check(m, run, prompt_ids) if run_sliding(cfg) else None
    fresh()
    cache_vs_full = cache_cross_check(m, run, prompt_ids)
    if m.guard is not None:
        assert not m.guard.bad, f"float64 run: ops produced other float dtypes: {dict(m.guard.bad)}"

    record = golden_io.record_section(sel.keep_steps, args.all_steps, sel.patterns, args.logits, sel.stages_at,
                                      args.row_list, run.step_tokens, sel.aux, sel.aux_rows)
    prov = hf_model.build_provenance(args, prompt, m.cfg_dict, run.greedy_ids, run.steps, cache_vs_full, source,
                                     record, sampling, RECORDER)
    if r.moe_stats is not None:  # MoE models only: layout, eager experts, margins, expert counts
        prov["moe"] = moe_hooks.provenance(r.moe_stats, golden_io.moe_layout(cfg), log)
    if m.rope_watch is not None:
        # Scaled RoPE only (other goldens keep their provenance).
        prov["rope"] = rope_scaling_f64.provenance(model, m.rope_watch, run.rope_passes, args.dtype)
    if run_sliding(cfg) and (sliding_vs_full_cache is not None or watch.found is None):
        # Sliding-window models only (other goldens keep their provenance).
        prov["sliding_cache_vs_full_cache_max_abs_diff"] = sliding_vs_full_cache
    if watch.found is not None:
        checks = ["cache_vs_full"] + (["sliding_cache_vs_full_cache"] if run_sliding(cfg) else [])
        prov["overflow"] = watch.found
        prov["overflow_skipped"] = overflow.skipped(watch.found, run.clean, run.not_run, checks)
    out, bf16 = run.out, []
    if args.dtype in ("bfloat16", "float16"):
        out, bf16 = golden_io.narrow_exact(out, args.dtype)
    golden_io.write_golden(out, golden_io.metadata(prov), args.out_file, log, bf16)
    log(oracle_f64.memory_line(m.model_bytes, m.f64_bytes))
    print_summary(args, run, out, prompt_ids, tok, cache_vs_full, sliding_vs_full_cache, pair_ties)
    watch.report()


def print_summary(args, run, out, prompt_ids, tok, cache_vs_full, sliding_vs_full_cache, pair_ties):
    """The JSON summary on stdout. The simple figure: mean row max of the
    prefill probabilities vs the uniform 1/S (S = prompt length). It
    flatters: causal row t sees only t+1 keys, so even perfectly uniform rows
    score well above 1/S. The per-row figures (each row against its own
    1/n_keys) are the honest measure and what INITIALIZER_RANGE in
    make_model.py was chosen on."""
    S0 = len(prompt_ids)
    pre_mean_max = float(np.mean(run.prefill_row_max)) if run.prefill_row_max else None  # None: overflowed
    print(json.dumps({
        "out": args.out_file,
        "tensors": len(out),
        "bytes": os.path.getsize(args.out_file),
        "sha256": sha256_file(args.out_file),
        "prompt_ids": prompt_ids,
        "greedy_ids": run.greedy_ids,
        "greedy_text": tok.decode(run.greedy_ids),
        "cache_vs_full_max_abs_diff": cache_vs_full,
        "sliding_cache_vs_full_cache_max_abs_diff": sliding_vs_full_cache,
        "dtype": args.dtype,
        "lm_head_pair_ties": bool(pair_ties),
        "logits_absmax": round(run.logit_absmax, 4),
        "attention": {
            "prefill_mean_row_max": None if pre_mean_max is None else round(pre_mean_max, 4),
            "prefill_uniform_1_over_S": round(1.0 / S0, 4),
            "prefill_mean_row_max_x_1_over_S": None if pre_mean_max is None else round(pre_mean_max * S0, 2),
            "prefill_rows": attention_summary(run.att_rows["prefill"]) if run.att_rows["prefill"] else None,
            "decode_rows": attention_summary(run.att_rows["decode"]) if run.att_rows["decode"] else None,
        },
    }))


if __name__ == "__main__":
    sys.exit(main())
