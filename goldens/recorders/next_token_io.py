"""The files of the next-token goldens: the prompt sets they are recorded
over (goldens/prompt-sets/*.yaml) and the `touchstone-next-token/1` files
themselves, as record_next_token.py reads and writes them.

read_prompt_set() checks a prompt set (`prompts`, a list of {name, text}:
unique names of [a-z0-9-]+, non-empty texts, no other key, no key given
twice); read_golden() a next-token golden of the same set (the --tokens-from
and --oracle files); distribution_summary() turns one prompt's logits into
what a file keeps per position (top-K ids and log-probabilities, the
log-probabilities at the oracle's ids, max |logit|). Problems with the
inputs are UserError: one line, exit 2.
"""
import hashlib
import io
import json
import os
import re

import numpy as np
import yaml
from safetensors import safe_open

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
def read_golden(path, what, names, set_sha):
    """(provenance, {name: {key: array}}) of a next-token golden of the same
    prompt set; UserError otherwise."""
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
    if prov.get("prompts") != names:
        raise UserError(f"{what} {path}: recorded for prompts {prov.get('prompts')}, the set has {names}")
    if prov.get("prompt_set", {}).get("sha256") != set_sha:
        raise UserError(f"{what} {path}: recorded from another version of the prompt set (sha256 "
                        f"{prov.get('prompt_set', {}).get('sha256')}, the set's is {set_sha}): record it again")
    per = {n: {} for n in names}
    for k, v in tensors.items():
        n, _, key = k.partition("/")
        per[n][key] = v
    return prov, per


def distribution_summary(logits, K, oracle_ids=None):
    """From one prompt's logits [T,V] (float64, exact upcast): top-K ids and
    log-probabilities, the log-probabilities at `oracle_ids` [T,K], and the
    max |logit| per position."""
    assert logits.dtype == np.float64 and logits.ndim == 2
    assert np.isfinite(logits).all(), "non-finite logits"
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


