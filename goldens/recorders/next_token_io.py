"""The files of the next-token goldens: the prompt sets they are recorded
over (goldens/prompt-sets/*.yaml) and the `touchstone-next-token/1` files
themselves, as record_next_token.py reads and writes them.

read_prompt_set() checks a prompt set (`prompts`, a list of {name, text}:
unique names of [a-z0-9-]+, non-empty texts, no other key, no key given
twice); read_golden() a next-token golden of the same set (the --tokens-from
and --oracle files); distribution_summary() turns one prompt's logits into
what a file keeps per position (top-K ids and log-probabilities, the
log-probabilities at the oracle's ids, max |logit|); overflowed() the
provenance entry of a prompt left out because its logits went non-finite.
Problems with the inputs are UserError: one line, exit 2.
"""
import hashlib
import io
import json
import os
import re

import numpy as np
import yaml
from safetensors import safe_open

import overflow

FORMAT = "touchstone-next-token/1"
NAME_RE = re.compile(r"[a-z0-9-]+")
# The checkout's root: prompt set paths are recorded relative to it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class UserError(Exception):
    """A problem with the inputs: reported as one line, exit 2."""


# ---- the prompt set -----------------------------------------------------------
class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error (PyYAML
    would keep the last silently)."""


def _unique_mapping(loader, node, deep=False):
    seen = set()
    for k, _ in node.value:
        key = loader.construct_object(k, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", k.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_prompt_set(path):
    """[(name, text)] of a prompt set, and the file's sha256; UserError for
    anything malformed."""
    if not os.path.isfile(path):
        raise UserError(f"--prompts {path}: no such file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        stream = io.StringIO(raw.decode("utf-8"))
        stream.name = path  # PyYAML names it in its messages
        doc = yaml.load(stream, Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts {path}: not UTF-8 ({e})") from None
    except yaml.YAMLError as e:
        raise UserError(f"--prompts {path}: bad YAML: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict):
        raise UserError(f"--prompts {path}: expected a mapping with the key `prompts`, got {type(doc).__name__}")
    unknown = sorted(str(k) for k in doc if k != "prompts")
    if unknown:
        raise UserError(f"--prompts {path}: unknown key(s) {', '.join(unknown)} (the only key is `prompts`)")
    items = doc.get("prompts")
    if not isinstance(items, list) or not items:
        raise UserError(f"--prompts {path}: `prompts` must be a non-empty list of {{name, text}}")
    out, seen = [], set()
    for i, it in enumerate(items):
        where = f"--prompts {path}: prompt {i + 1}"
        if not isinstance(it, dict):
            raise UserError(f"{where}: expected a mapping {{name, text}}, got {type(it).__name__}")
        unknown = sorted(str(k) for k in it if k not in ("name", "text"))
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (keys: name, text)")
        name, text = it.get("name"), it.get("text")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise UserError(f"{where}: name {name!r} must match [a-z0-9-]+")
        where = f"--prompts {path}: prompt `{name}`"
        if name in seen:
            raise UserError(f"{where}: the name is used twice")
        seen.add(name)
        if not isinstance(text, str):
            raise UserError(f"{where}: `text` must be a string, got {type(text).__name__}")
        if not text.strip():
            raise UserError(f"{where}: the text is empty")
        out.append((name, text))
    return out, hashlib.sha256(raw).hexdigest()


def set_path_for_provenance(path):
    """The prompt set's path as provenance records it: relative to this
    checkout's root when the file is inside it (so regen.sh and `touchstone
    goldens regen`, run from anywhere, record the same bytes), else as given."""
    real = os.path.realpath(path)
    root = os.path.realpath(ROOT)
    if real.startswith(root + os.sep):
        return os.path.relpath(real, root).replace(os.sep, "/")
    return path


# ---- next-token golden files ----------------------------------------------------
def left_out(prov):
    """{name: entry} of the prompts a golden left out because its logits
    went non-finite (provenance `overflow.prompts`)."""
    return {e["prompt"]: e for e in (prov.get("overflow") or {}).get("prompts", [])}


def read_golden(path, what, names, set_sha):
    """(provenance, {name: {key: array}}) of a next-token golden of the same
    prompt set; UserError otherwise. A prompt the golden left out (an
    overflow) has only its `tokens` here, from the provenance, and its name
    in left_out(provenance)."""
    if not os.path.isfile(path):
        raise UserError(f"{what} {path}: no such file")
    try:
        with safe_open(path, "np") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise UserError(f"{what} {path}: not a safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{what} {path}: not a {FORMAT} file (format {meta.get('format')!r})")
    prov = json.loads(meta["provenance"])
    skipped = left_out(prov)
    written = [n for n in names if n not in skipped]
    if prov.get("prompts") != written or not set(skipped) <= set(names):
        raise UserError(f"{what} {path}: recorded for prompts {prov.get('prompts')} (left out: "
                        f"{sorted(skipped)}), the set has {names}")
    if prov.get("prompt_set", {}).get("sha256") != set_sha:
        raise UserError(f"{what} {path}: recorded from another version of the prompt set (sha256 "
                        f"{prov.get('prompt_set', {}).get('sha256')}, the set's is {set_sha}): record it again")
    per = {n: {} for n in names}
    for k, v in tensors.items():
        n, _, key = k.partition("/")
        per[n][key] = v
    for n, e in skipped.items():
        per[n]["tokens"] = np.array(e["tokens"], dtype=np.int64)
    return prov, per


def distribution_summary(logits, K, oracle_ids=None):
    """From one prompt's logits [T,V] (float64, exact upcast): top-K ids and
    log-probabilities, the log-probabilities at `oracle_ids` [T,K], and the
    max |logit| per position."""
    assert logits.dtype == np.float64 and logits.ndim == 2
    assert np.isfinite(logits).all(), "non-finite logits (record_next_token.py leaves such a prompt out)"
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    lp = logits - lse
    # A stable sort of -lp keeps equal values in index order: ties go to the
    # lower id.
    top = np.ascontiguousarray(np.argsort(-lp, axis=1, kind="stable")[:, :K]).astype(np.int64)
    out = {
        "top_ids": top,
        "top_logprobs": np.ascontiguousarray(np.take_along_axis(lp, top, axis=1)),
        "logit_max": np.ascontiguousarray(np.abs(logits).max(axis=1)),
    }
    assert (np.diff(out["top_logprobs"], axis=1) <= 0).all()
    if oracle_ids is not None:
        out["at_oracle"] = np.ascontiguousarray(np.take_along_axis(lp, oracle_ids, axis=1))
    return out


def overflowed(name, ids, logits, stages, oracle):
    """The provenance entry of a prompt whose logits went non-finite: the
    first position whose logits are non-finite, the earliest stage of the
    forward holding a non-finite value (stages(name): every stage in
    execution order; "logits" when it cannot tell) with its first such row,
    its count and largest finite |x|, and from --oracle the largest |logit|
    of the oracle's forward over the prompt (oracle_max_abs, for the stage
    logits; null for another, which the oracle's file does not hold) and at
    that position (oracle_logit_max). `tokens`: the ids fed, so that a file
    fed this one's tokens (--tokens-from) still has them."""
    position = int(np.nonzero(~np.isfinite(logits).all(axis=1))[0][0])
    tensors, order = stages(name)
    hit = overflow.first_nonfinite(tensors, order) if tensors is not None else None
    stage, v = hit if hit is not None else ("logits", logits)
    n, biggest = overflow.describe(v)
    lm = None if oracle is None else oracle[name]["logit_max"]
    return {"prompt": name, "position": position, "stage": stage, "row": overflow.first_row(stage, v),
            "nonfinite": n, "max_abs_finite_before": biggest,
            "oracle_max_abs": float(lm.max()) if lm is not None and stage == "logits" else None,
            "oracle_logit_max": None if lm is None else float(lm[position]), "tokens": [int(t) for t in ids]}

