"""Shared by the golden recorders: the golden file format and its
deterministic writer (record_hf.py and record_llamacpp.py write the same
format, so an engine test reads either source the same way), the stage
vocabulary of each architecture, and the record subsets (--steps, --stages,
--stages-at, --rows, --logits) with the provenance entry that says what a
golden holds."""
import hashlib
import json
import os
import re
import struct
import sys

import numpy as np
import safetensors
from safetensors.numpy import load_file, save

FORMAT = "touchstone-golden/1"


def narrow_exact(tensors, dtype):
    """A 16-bit reference's tensors (float32 arrays holding values of `dtype`,
    "bfloat16" or "float16") in that dtype where the conversion is exact,
    which halves the file; a stage computed in float32 (one of HF's float32
    islands) stays float32. Returns (tensors, keys to store as BF16): numpy
    has no bfloat16, so those stay float32 here and save_deterministic
    writes their upper 16 bits, exact by this check."""
    out, bf16 = dict(tensors), []
    for k, v in tensors.items():
        if v.dtype != np.float32:
            continue
        if dtype == "float16":
            h = v.astype(np.float16)
            if np.array_equal(h.astype(np.float32), v):
                out[k] = h
        elif dtype == "bfloat16" and not (v.view(np.uint32) & 0xFFFF).any():
            bf16.append(k)
    return out, bf16


def _read_back(path):
    """Every tensor of a safetensors file as numpy (BF16 widened to float32),
    and its metadata: the writer's own check, for files the numpy library
    cannot read (BF16)."""
    types = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U16": np.uint16}
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    out = {}
    for k, h in header.items():
        a, b = h["data_offsets"]
        if h["dtype"] == "BF16":
            v = (np.frombuffer(data[a:b], dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            v = np.frombuffer(data[a:b], dtype=np.dtype(types[h["dtype"]]).newbyteorder("<"))
        out[k] = v.reshape(h["shape"])
    return out, meta, header


def save_deterministic(tensors, metadata, path, bf16=()):
    """Write a safetensors file whose bytes depend only on the inputs.

    The safetensors library keeps `__metadata__` in a Rust HashMap, whose
    iteration order is randomised per process: with two metadata keys the
    header came out in either order on different runs (seen with 0.8.0).
    Keep the library's tensor layout (dtype, then name: aligned, and
    deterministic) but re-serialise the header with `__metadata__` first
    and its keys sorted. Offsets are relative to the data section, so
    rewriting the header leaves them valid.

    `bf16`: keys of float32 tensors whose values are all bfloat16
    (narrow_exact): stored as BF16, their upper 16 bits passed through the
    library as U16 and the header's dtype renamed.
    """
    enc = dict(tensors)
    for k in bf16:
        u = tensors[k].view(np.uint32)
        assert tensors[k].dtype == np.float32 and not (u & 0xFFFF).any(), f"{k} is not bfloat16-exact"
        enc[k] = (u >> 16).astype(np.uint16)
    blob = save(dict(sorted(enc.items())), metadata=metadata)
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])  # dicts keep the file's order
    meta = header.pop("__metadata__")
    assert meta == metadata
    for k in bf16:
        assert header[k]["dtype"] == "U16"
        header[k]["dtype"] = "BF16"
    header = {"__metadata__": dict(sorted(meta.items())), **header}
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (-len(hb) % 8)  # the format pads the header with spaces to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + blob[8 + n:])
    if bf16:
        back, meta, header = _read_back(path)
        assert meta == metadata and sorted(back) == sorted(tensors)
        assert all(np.array_equal(back[k], tensors[k]) for k in tensors)
        assert all(back[k].dtype == tensors[k].dtype for k in tensors if k not in bf16)
        return
    # Read it back through the library: same tensors, same metadata.
    back = load_file(path)
    assert sorted(back) == sorted(tensors)
    assert all(np.array_equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype for k in tensors)
    with safetensors.safe_open(path, "np") as f:
        assert f.metadata() == metadata


def metadata(prov, fmt=FORMAT):
    """A golden's `__metadata__`: its format and its provenance as compact
    sorted-key JSON (nothing that varies between runs)."""
    return {"format": fmt, "provenance": json.dumps(prov, sort_keys=True, separators=(",", ":"), allow_nan=False)}


def write_golden(tensors, meta, path, log=None, bf16=()):
    """save_deterministic into `path` through a temporary name and a rename,
    so a failed run never leaves a half-written golden behind. Replacing a
    file is what the callers ask for (regen.sh starts from empty folders,
    goldens regen from a fresh one), but never silently: `log` says so, and
    what was written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_deterministic(tensors, meta, tmp, bf16)
    if log is not None and os.path.exists(path):
        log(f"replacing the existing {path}")
    os.replace(tmp, path)
    if log is not None:
        log(f"wrote {path}: {len(tensors)} tensors, {os.path.getsize(path)} bytes")


# ---- stage vocabulary and record subsets (shared by both recorders) --------
# The canonical block stages in execution order (src/stage/mod.rs). q_norm/k_norm
# exist only for architectures with a per-head RMSNorm of q and k before RoPE
# (Qwen3, Gemma 3); attn_post_norm (the norm of the attention output, before
# the residual add) and ffn_post_norm (the norm of the FFN output) only for
# Gemma 3; every other stage exists for every supported architecture.
# A mixture-of-experts layer (moe_layout) has the ffn_moe_* stages (and ffn_shexp_out where it has a
# shared expert) in place of ffn_gate, ffn_up and ffn_act; a dense layer of a MoE model has none of them.
BLOCK_STAGES = ["attn_norm", "q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "attn_scores",
                "attn_probs", "attn_ctx", "attn_out", "attn_post_norm", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up",
                "ffn_act", "ffn_moe_logits", "ffn_moe_probs", "ffn_moe_topk", "ffn_moe_weights", "ffn_moe_out",
                "ffn_shexp_out", "ffn_out", "ffn_post_norm", "out"]
# Gemma 3 is `gemma3_text` in HF configs, `gemma3` in GGUFs.
QK_NORM_TYPES = {"qwen3", "gemma3", "gemma3_text", "qwen3_moe", "qwen3moe"}
POST_NORM_TYPES = {"gemma3", "gemma3_text"}
DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_act")
MOE_FFN = ("ffn_moe_logits", "ffn_moe_probs", "ffn_moe_topk", "ffn_moe_weights", "ffn_moe_out")
# HF model_type of the MoE families -> (key of the number of routed experts, has a shared expert).
MOE_TYPES = {"mixtral": ("num_local_experts", False), "qwen2_moe": ("num_experts", True),
             "qwen3_moe": ("num_local_experts", False), "deepseek_v3": ("n_routed_experts", True),
             "gpt_oss": ("num_local_experts", False)}


def block_stages(model_type, kind="dense"):
    """The stages of one block: `kind` "dense", "moe" or "moe+shexp" (moe_layout)."""
    qk_norm = model_type in QK_NORM_TYPES
    post_norm = model_type in POST_NORM_TYPES
    return [s for s in BLOCK_STAGES if (qk_norm or s not in ("q_norm", "k_norm"))
            and (post_norm or s not in ("attn_post_norm", "ffn_post_norm"))
            and (kind != "dense" or s not in MOE_FFN + ("ffn_shexp_out",))
            and (kind == "dense" or s not in DENSE_FFN) and (kind == "moe+shexp" or s != "ffn_shexp_out")]


def block_stage_union(model_type, layout=None):
    """Every stage any block of the model has, in canonical order."""
    kinds = set(layout or ["dense"])
    have = {s for k in kinds for s in block_stages(model_type, k)}
    return [s for s in BLOCK_STAGES if s in have]


def moe_layout(cfg):
    """Per layer "dense", "moe" or "moe+shexp" for a MoE family's HF config (a dict, or a config object),
    None for a dense family: Qwen2/3-MoE route layer i unless it is in mlp_only_layers or (i + 1) %
    decoder_sparse_step != 0, DeepSeek-V3 from first_k_dense_replace on, Mixtral and gpt-oss every layer."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    mt = get("model_type")
    if mt not in MOE_TYPES:
        return None
    n = get("num_hidden_layers")
    shared = MOE_TYPES[mt][1] and bool(get("shared_expert_intermediate_size", 1) and get("n_shared_experts", 1))
    if mt in ("qwen2_moe", "qwen3_moe"):
        step, only = get("decoder_sparse_step") or 1, set(get("mlp_only_layers") or [])
        sparse = [i not in only and (i + 1) % step == 0 for i in range(n)]
    elif mt == "deepseek_v3":
        sparse = [i >= get("first_k_dense_replace", 0) for i in range(n)]
    else:
        sparse = [True] * n
    return [("moe+shexp" if shared else "moe") if sp else "dense" for sp in sparse]


# Stages after the logits that only some recordings have (record_hf.py
# --sample-probs): the sampling distribution of the last row.
OPTIONAL_STAGES = ["sample_probs"]


def all_stages(model_type, n_layers, extra=(), layout=None):
    """Every canonical stage of one step of this model, in execution order,
    plus the optional stages in `extra` (a subset of OPTIONAL_STAGES).
    `layout`: a MoE model's moe_layout (None: every block dense)."""
    assert set(extra) <= set(OPTIONAL_STAGES), extra
    assert layout is None or len(layout) == n_layers, (layout, n_layers)
    names = ["embed"]
    for li in range(n_layers):
        names += [f"blk.{li}.{s}" for s in block_stages(model_type, layout[li] if layout else "dense")]
    return names + ["output_norm", "logits"] + [s for s in OPTIONAL_STAGES if s in extra]


# A vision-language model's vision stages per block (record_vlm.py).
VISION_BLOCK_STAGES = ["norm1", "q", "k", "v", "q_rope", "k_rope", "attn_probs", "attn_ctx", "attn_out", "mlp_inp",
                       "norm2", "mlp_fc1", "mlp_act", "mlp_out", "out"]


# LLaVA's CLIP tower has no RoPE; its stages around the blocks (issue 39):
# the embeddings (class row + patches + learned positions), pre_layrnorm, the
# selected features (CLS dropped), the projector and the packed image rows.
LLAVA_TYPES = ("llava", "llava_next")
LLAVA_VISION_BLOCK_STAGES = [s for s in VISION_BLOCK_STAGES if s not in ("q_rope", "k_rope")]


def vision_stages(model_type, depth, n_deepstack):
    """A VLM's vision stages (prefill only), in execution order as
    docs/stages-and-checks.md lists them (`vision.grid` is an integer
    tensor)."""
    if model_type in LLAVA_TYPES:
        names = ["vision.pixels", "vision.patch_embed", "vision.pos_embed", "vision.pre_norm"]
        for i in range(depth):
            names += [f"vision.blk.{i}.{s}" for s in LLAVA_VISION_BLOCK_STAGES]
        return names + ["vision.features", "vision.proj_fc1", "vision.proj_act", "vision.projector", "vision.merger"]
    names = ["vision.pixels", "vision.grid", "vision.patch_embed"]
    if model_type == "qwen3_vl":
        names.append("vision.pos_embed")
    for i in range(depth):
        names += [f"vision.blk.{i}.{s}" for s in VISION_BLOCK_STAGES]
    names += ["vision.merger_norm", "vision.merger"] + [f"vision.deepstack.{j}" for j in range(n_deepstack)]
    return names


def vlm_order(model_type, lm_family, depth, n_deepstack, n_layers, prefill):
    """Every stage of one step of a VLM in execution order: at the prefill
    the vision stages, `embed`, `inputs_embeds`, then the language model's
    stages with `blk.{i}.deepstack` after `blk.{i}.out` (Qwen3-VL); a decode
    step has the language model's stages only."""
    lm = all_stages(lm_family, n_layers)
    if not prefill:
        return lm
    out = vision_stages(model_type, depth, n_deepstack) + ["embed", "inputs_embeds"]
    for s in lm[1:]:
        out.append(s)
        i = s.split(".")[1] if s.startswith("blk.") and s.endswith(".out") else None
        if i is not None and int(i) < n_deepstack:
            out.append(f"blk.{i}.deepstack")
    return out


def pattern_matches(pattern, stage):
    """The spec pattern language (src/stage/pattern.rs): dot-separated parts
    match one for one, `*` matches any single part, a bare `*` everything."""
    if pattern == "*":
        return True
    p, s = pattern.split("."), stage.split(".")
    return len(p) == len(s) and all(a == "*" or a == b for a, b in zip(p, s))


class SelectionError(ValueError):
    pass


def parse_stages(text, model_type, n_layers, extra=(), what="--stages", layout=None):
    """`--stages` (comma-separated patterns) -> (patterns, selected stage set).
    A pattern that matches no stage of this model is an error, as in a spec:
    a typo must not silently record nothing. `extra`: the optional stages
    this recording has (see all_stages)."""
    pats = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in pats):
        raise SelectionError(f"{what} {text!r}: empty pattern (give comma-separated patterns, e.g. 'embed,blk.0.*,logits')")
    stages = all_stages(model_type, n_layers, extra, layout)
    generic = sorted({re.sub(r"^blk\.\d+\.", "blk.*.", s) for s in stages})
    chosen = set()
    for p in pats:
        hit = [s for s in stages if pattern_matches(p, s)]
        if not hit:
            raise SelectionError(
                f"{what}: pattern {p!r} matches no stage of this {model_type} model with {n_layers} layers "
                f"(stages: {', '.join(generic)}; `*` matches one dot-separated part, a bare `*` every stage)")
        chosen.update(hit)
    return pats, chosen


def parse_steps(text, decode_steps):
    """`--steps` (comma-separated `prefill`, `decodeN`) -> the steps to store,
    in run order. Every step still runs (a later decode step needs the KV
    cache of all earlier ones); only its stages are left out."""
    known = ["prefill"] + [f"decode{i}" for i in range(1, decode_steps + 1)]
    want = [s.strip() for s in text.split(",")]
    bad = [s for s in want if s not in known]
    if bad or not want:
        raise SelectionError(f"--steps: unknown step(s) {bad} (with --decode-steps {decode_steps} the steps are "
                             f"{', '.join(known)})")
    if len(set(want)) != len(want):
        raise SelectionError(f"--steps {text!r}: a step is named twice")
    return [s for s in known if s in want]


class Dims(tuple):
    """(H, KV, D, E, F, V, layers), and for a MoE model `n_expert` and `top_k` (None otherwise); for
    multi-head latent attention (DeepSeek-V3) D is the q/k head (qk_nope + qk_rope dims) and `d_v` the
    value head."""
    n_expert = top_k = d_v = None


def model_dims(cfg):
    """(H, KV, D, E, F, V, layers) from an HF config dict (a Dims; a MoE
    family's also has n_expert and top_k). head_dim is optional in most
    configs (hidden / heads when absent); num_key_value_heads too."""
    H = cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads") or H
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    if cfg.get("kv_lora_rank"):  # MLA: config.json's head_dim is the RoPE part only
        D = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    dims = Dims((H, KV, D, cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]))
    if cfg.get("kv_lora_rank"):
        dims.d_v = cfg["v_head_dim"]
    if cfg.get("model_type") in MOE_TYPES:
        dims.n_expert, dims.top_k = cfg[MOE_TYPES[cfg["model_type"]][0]], cfg["num_experts_per_tok"]
    return dims


def dims_v(dims):
    """The value head size: D, or MLA's v_head_dim."""
    return getattr(dims, "d_v", None) or dims[2]


def expected_shape(stage, T, S, dims, logits_last=False):
    """The canonical layout of `stage` for a step of T tokens, S positions."""
    H, KV, D, E, F, V, _ = dims
    name = stage.split(".")[-1]
    if name in MOE_FFN[:4]:
        return (T, dims.n_expert if name in ("ffn_moe_logits", "ffn_moe_probs") else dims.top_k)
    return {
        "tokens": (T,), "positions": (T,), "logits": (1 if logits_last else T, V),
        "q": (T, H, D), "q_norm": (T, H, D), "q_rope": (T, H, D),
        "k": (T, KV, D), "k_norm": (T, KV, D), "k_rope": (T, KV, D), "v": (T, KV, dims_v(dims)),
        "attn_scores": (H, T, S), "attn_probs": (H, T, S), "attn_ctx": (T, H * dims_v(dims)),
        "sample_probs": (1, V),
        "ffn_gate": (T, F), "ffn_up": (T, F), "ffn_act": (T, F),
    }.get(name, (T, E))  # embed, norms (attn_post_norm, ffn_post_norm too), attn_out, ffn_inp, ffn_out, out


def parse_stages_at(items, model_type, n_layers, decode_steps, extra=(), what="--stages-at", layout=None):
    """`--stages-at STEP=PATTERN[,PATTERN]` (repeatable) -> ({step: patterns},
    {step: selected stage set}): stages stored at that one step only, on top
    of --steps x --stages (a long prompt's [H,T,S] prefill scores would not
    fit in a committed file, its decode steps' do). `--aux` is parsed the
    same way (`what` names the option in messages)."""
    pats, sets = {}, {}
    for item in items:
        step, eq, text = item.partition("=")
        step = step.strip()
        if not eq:
            raise SelectionError(f"{what} {item!r}: expected STEP=PATTERN[,PATTERN...]")
        try:
            parse_steps(step, decode_steps)  # a known step
        except SelectionError as e:
            raise SelectionError(f"{what} {item!r}: {e}") from None
        if step in pats:
            raise SelectionError(f"{what}: step {step} named twice")
        pats[step], sets[step] = parse_stages(text, model_type, n_layers, extra, what=f"{what} {step}",
                                              layout=layout)
    return pats, sets


def parse_rows(text):
    """`--rows` (comma-separated token rows, negative from the end, e.g.
    `0,-1`) -> the list as given. Every stage with a token axis then keeps
    only those rows at every step (a decode step's one row is row 0 and row
    -1 at once), so every stage of several layers of a real model fits a
    committed file. tokens/positions are always whole; the logits follow
    --logits (`last` keeps the last row whatever --rows says)."""
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        raise SelectionError(f"--rows {text!r}: expected comma-separated integers (e.g. 0,-1)") from None
    if not rows or len(set(rows)) != len(rows):
        raise SelectionError(f"--rows {text!r}: give each row once, at least one")
    return rows


def row_axis(stage):
    """The token axis of a stage's canonical layout (expected_shape), or None
    for a stage kept whole."""
    name = stage.split(".")[-1]
    if name in ("tokens", "positions", "sample_probs"):
        return None
    return 1 if name in ("attn_scores", "attn_probs") else 0


def resolve_rows(rows, T):
    """The rows of a step of T tokens that `rows` names, ascending: row r < 0
    counts from the end; rows outside the step are left out."""
    return sorted({r % T for r in rows if -T <= r < T})


def take_rows(stage, v, rows, T):
    """`v` (a `stage` tensor of a T-token step) restricted to `rows`."""
    axis = row_axis(stage)
    if axis is None:
        return v
    assert v.shape[axis] == T, f"{stage}: axis {axis} has {v.shape[axis]} rows, the step {T} tokens"
    return np.ascontiguousarray(np.take(v, resolve_rows(rows, T), axis=axis))


def record_section(steps_stored, all_steps, patterns, logits, stages_at=None, rows=None, step_tokens=None,
                   aux=None, aux_rows=None):
    """The provenance `record` entry, or None when everything was recorded
    (every step, every stage, every logits row): absent means complete, which
    keeps full recordings byte-identical to those made before subsets existed.

    `stages_at` ({step: patterns}, from --stages-at) becomes the key
    `stages_at`: stages stored at those steps only, in addition to `steps` x
    `stages`. A reader that does not know the key claims nothing for them
    (they are not in `stages`), so it never expects a tensor that is absent.

    `rows` (from --rows) becomes `rows` ({step: the rows kept there}, for
    every step, given `step_tokens` {step: T}) and `rows_asked` (as given):
    a reader compares a whole tensor with a golden on those rows.

    `aux` ({step: patterns}, from --aux) becomes `aux`, steps in step order
    and patterns as given: auxiliary tensors stored with every token row
    (whatever `rows` and `logits` say), read to compute error floors, never
    checked themselves. `aux_rows` (from --aux-rows) becomes `aux_rows`: the
    same, but stored on the rows `rows` keeps (a stage's inputs, read on the
    rows it is judged on).
    """
    if steps_stored == all_steps and patterns == ["*"] and logits == "all" and not stages_at and not rows \
            and not aux and not aux_rows:
        return None
    rec = {"steps": steps_stored, "stages": patterns, "logits": logits}
    if stages_at:
        rec["stages_at"] = {s: stages_at[s] for s in all_steps if s in stages_at}
    if aux:
        rec["aux"] = {s: aux[s] for s in all_steps if s in aux}
    if aux_rows:
        rec["aux_rows"] = {s: aux_rows[s] for s in all_steps if s in aux_rows}
    if rows:
        rec["rows_asked"] = list(rows)
        rec["rows"] = {s: resolve_rows(rows, step_tokens[s]) for s in all_steps}
    return rec


def stored(step, stage, keep_steps, keep_stages, stages_at_sets, aux_rows_sets=None):
    """Whether `step/stage` is stored under --steps/--stages/--stages-at
    (or --aux-rows: on the kept rows, as these are)."""
    return (step in keep_steps and stage in keep_stages) or stage in stages_at_sets.get(step, ()) \
        or stage in (aux_rows_sets or {}).get(step, ())


def select_step(step, tensors, sel, T, keeps=None):
    """What a golden stores of one step's canonical tensors {stage: array}
    (every stage, every row; T tokens): tokens and positions always; an
    auxiliary stage (sel.aux_sets, --aux) whole, every row; any other stage
    under --steps/--stages/--stages-at/--aux-rows, with only the last logits row
    (sel.logits "last") or only the rows of sel.rows. `keeps(stage)`: False
    for the stages at and after an overflow (overflow.Watch.keeps)."""
    out = {}
    for k, v in tensors.items():
        if k in ("tokens", "positions"):
            out[k] = v
        elif keeps is not None and not keeps(k):
            continue
        elif k in sel.aux_sets.get(step, ()):
            out[k] = v
        elif stored(step, k, sel.keep_steps, sel.keep, sel.stages_at_sets, getattr(sel, "aux_rows_sets", None)):
            if k == "logits" and sel.logits == "last":
                v = np.ascontiguousarray(v[-1:])
            elif sel.rows is not None:
                v = take_rows(k, v, sel.rows, T)
            out[k] = v
    return out


def read_tokens(path, ap):
    """The token ids a golden fed at each step, its steps and its prompt
    (record_hf.py --tokens-from; `ap.error` for a missing or foreign file)."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        ap.error(f"--tokens-from {path} does not exist")
    with safe_open(path, "np") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            ap.error(f"--tokens-from {path} is not a {FORMAT} file (format {meta.get('format')!r})")
        prov = json.loads(meta["provenance"])
        tokens = {s: [int(x) for x in f.get_tensor(f"{s}/tokens")] for s in prov["steps"]}
    return {"steps": prov["steps"], "tokens": tokens, "prompt": prov["prompt"]}


def sha256_file(path):
    """Streamed: model files can be gigabytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def progress(tool, msg):
    """A progress line on stderr (stdout carries the JSON summary);
    `touchstone goldens regen` relays lines of this form."""
    print(f"{tool}: {msg}", file=sys.stderr, flush=True)
