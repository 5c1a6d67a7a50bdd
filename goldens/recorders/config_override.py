"""A spec's `config:` override of the model's HF config, as the recorders
apply it (record_hf.py and record_llamacpp.py `--config-override JSON`).

`touchstone goldens regen` passes a spec's `config:` mapping to both
recorders as compact JSON (src/cmd/goldens/args.rs), and the engines apply
the same mapping to the model they run (src/model/config.rs). So the
override means here exactly what it means there: merge() is
src/model/config.rs's `merge_override`. Each top-level key replaces the
config's key, except `rope_scaling` and `rope_parameters`, whose entries
update the RoPE parameters the config already has: into `rope_parameters`
when the config has that mapping (transformers 5), else into `rope_scaling`
when it has that one, else into a new mapping under the key given; an entry
`type` is written as `rope_type`, and everything else in the mapping
(rope_theta, ...) is kept. Keys are taken in sorted order, as serde_json's
maps hold them (where `rope_scaling` and `rope_parameters` both set a key,
`rope_scaling`'s wins, as in touchstone).

A GGUF model takes only `rope_scaling`, `rope_parameters` and
`max_position_embeddings`, and only when its config has no RoPE scaling of
its own (touchstone's `with_gguf_override`); anything else exits with a
clear message, as does an override of a model whose RoPE parameters are kept
per layer type (Gemma 3: the merge would write scalar entries beside the
per-type mappings, a config no reference could run).

hf_config() builds the transformers config the model is loaded with (the
merged dict through the model's own config class); check_applied() asserts
the loaded model carries it: every overridden key as given (in the config
transformers built and in the config.json form the provenance records), and
the rotary module's scaling as rope_scaling_f64.py computes it from the
merged config (for YaRN without an explicit attention factor, 0.1 ln(factor)
+ 1). The golden's provenance gets `config_override`, the override exactly
as parsed (a JSON object: touchstone compares it with the spec's `config:`),
and `model_config` is the merged config.
"""
import copy
import json
import math
import os
import sys

ROPE_KEYS = ("rope_parameters", "rope_scaling")
GGUF_KEYS = ("max_position_embeddings", "rope_parameters", "rope_scaling")


def fail(tool, msg):
    """One line on stderr and exit 2: an override this model cannot take."""
    print(f"{tool}: --config-override: {msg}", file=sys.stderr)
    sys.exit(2)


def parse(text, tool):
    """The override given as JSON text: a non-empty mapping whose RoPE keys
    are mappings (exit 2 with one line otherwise)."""
    try:
        over = json.loads(text)
    except ValueError as e:
        fail(tool, f"not valid JSON ({e}): {text!r}")
    if not isinstance(over, dict) or not over:
        fail(tool, f"expected a non-empty mapping (a JSON object) of HF config keys, got {text!r}")
    for k in ROPE_KEYS:
        if k in over and not isinstance(over[k], dict):
            fail(tool, f"`{k}` is {json.dumps(over[k])}, expected a mapping")
    return over


def merge(base, over):
    """src/model/config.rs's merge_override of `over` into a copy of `base`
    (the config.json form)."""
    out = copy.deepcopy(base)
    for k in sorted(over):
        x = over[k]
        if k in ROPE_KEYS:
            into = "rope_parameters" if isinstance(out.get("rope_parameters"), dict) else \
                "rope_scaling" if isinstance(out.get("rope_scaling"), dict) else k
            if not isinstance(out.get(into), dict):
                out[into] = {}
            for pk in sorted(x):
                out[into]["rope_type" if pk == "type" else pk] = copy.deepcopy(x[pk])
        else:
            out[k] = copy.deepcopy(x)
    return out


def rope_entries(over):
    """The RoPE entries the override sets, as they land in the config
    ({key: value}, `type` written as `rope_type`, in merge order)."""
    out = {}
    for k in sorted(over):
        if k in ROPE_KEYS:
            for pk in sorted(over[k]):
                out["rope_type" if pk == "type" else pk] = over[k][pk]
    return out


def per_layer_type(rp):
    """Whether RoPE parameters are kept per layer type (Gemma 3)."""
    return isinstance(rp, dict) and "rope_theta" not in rp and any(isinstance(v, dict) for v in rp.values())


def check_keys(over, gguf, tool):
    """The override's keys for this kind of model: exit 2 with the reason
    for one a GGUF cannot take."""
    if gguf:
        bad = [k for k in sorted(over) if k not in GGUF_KEYS]
        if bad:
            fail(tool, f"`{bad[0]}` cannot override a GGUF model's config (a GGUF takes "
                     f"{', '.join(GGUF_KEYS)}; give an HF model folder for other keys)")


def gguf_scaling(path):
    """The GGUF's own RoPE scaling keys (`<arch>.rope.scaling.type` other
    than none, `.factor` other than 0 or 1), as text, or None: transformers'
    GGUF loader does not read them, touchstone refuses such a GGUF."""
    from gguf import GGUFReader  # the pinned package transformers reads GGUFs with
    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    out = []
    for k in (f"{arch}.rope.scaling.type", f"{arch}.rope.scaling.factor"):
        f = r.fields.get(k)
        v = None if f is None else f.contents()
        if v is not None and v not in ("none", 0, 0.0, 1, 1.0):
            out.append(f"{k} = {v}")
    return ", ".join(out) or None


def hf_config(load_dir, load_kw, gguf, over, tool, log):
    """(config object, merged config.json dict) of a model loaded with the
    override: the model's own config (config.json, or what transformers
    derives from the GGUF) merged, then built by the model's config class
    from the merged dict, as from_pretrained builds it from config.json."""
    from transformers import AutoConfig
    check_keys(over, gguf, tool)
    base_cfg = AutoConfig.from_pretrained(load_dir, **load_kw)
    if gguf:
        base = json.loads(base_cfg.to_json_string(use_diff=False))
    else:
        with open(os.path.join(load_dir, "config.json")) as f:
            base = json.load(f)
    rp = base.get("rope_parameters") if isinstance(base.get("rope_parameters"), dict) else base.get("rope_scaling")
    if any(k in over for k in ROPE_KEYS) and per_layer_type(rp):
        fail(tool, f"this model keeps its RoPE parameters per layer type ({sorted(rp)}); a rope_scaling/"
                   "rope_parameters override cannot be merged into them")
    if gguf:
        scaled = gguf_scaling(os.path.join(load_dir, load_kw["gguf_file"]))
        if isinstance(rp, dict) and rp.get("rope_type", rp.get("type", "default")) != "default":
            scaled = json.dumps(rp)
        if scaled:
            fail(tool, f"the model already has RoPE scaling ({scaled}); an override cannot be merged into it")
    merged = merge(base, over)
    cfg = type(base_cfg).from_dict(merged)
    log(f"config override {json.dumps(over, sort_keys=True)}: "
        f"rope_parameters {json.dumps(getattr(cfg, 'rope_parameters', None), sort_keys=True)}")
    return cfg, merged


def _same(a, b):
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) or a == b


def check_applied(model, cfg_dict, merged, over):
    """Asserts the loaded model carries the override: every key as given in
    the config transformers built and in `cfg_dict` (what the provenance
    records as model_config), and a scaled RoPE's rotary module holds the
    scaling rope_scaling_f64.py computes from that config (YaRN without an
    explicit attention factor: 0.1 ln(factor) + 1). Returns the rotary
    module's (rope_type, attention_scaling)."""
    import rope_scaling_f64
    cfg = model.config
    for k in sorted(over):
        if k in ROPE_KEYS:
            continue
        assert _same(getattr(cfg, k), over[k]), f"config override: {k} is {getattr(cfg, k)!r}, not {over[k]!r}"
        assert _same(cfg_dict.get(k), over[k]), f"config override: model_config's {k} is {cfg_dict.get(k)!r}"
    rot = model.model.rotary_emb
    entries = rope_entries(over)
    if entries:
        rp = cfg.rope_parameters
        for k, v in entries.items():
            assert k in rp and _same(rp[k], v), f"config override: rope_parameters[{k!r}] is {rp.get(k)!r}, not {v!r}"
        rpd = cfg_dict.get("rope_parameters") if isinstance(cfg_dict.get("rope_parameters"), dict) else \
            cfg_dict.get("rope_scaling") or {}
        for k, v in entries.items():
            assert _same(rpd.get(k), v), f"config override: model_config's rope entry {k} is {rpd.get(k)!r}, not {v!r}"
        assert rot.rope_type == rp["rope_type"], f"rotary module has rope_type {rot.rope_type}, not {rp['rope_type']}"
        if rope_scaling_f64.is_scaled(cfg):
            att = rope_scaling_f64.inv_freq_f64(cfg)[1]
            assert abs(float(rot.attention_scaling) - att) <= 1e-12 * att, \
                f"rotary attention_scaling {rot.attention_scaling}, the {rp['rope_type']} rule gives {att}"
            if rp["rope_type"] == "yarn" and not any(rp.get(x) for x in ("attention_factor", "mscale",
                                                                           "mscale_all_dim")):
                f = float(rp.get("factor") or cfg.max_position_embeddings / rp["original_max_position_embeddings"])
                yarn = 0.1 * math.log(f) + 1.0 if f > 1 else 1.0
                assert abs(float(rot.attention_scaling) - yarn) <= 1e-12, \
                    f"YaRN attention_scaling {rot.attention_scaling}, not 0.1 ln {f} + 1 = {yarn}"
    return rot.rope_type, float(rot.attention_scaling)
