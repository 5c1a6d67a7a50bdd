"""What identifies the model an HF recorder reads, and how a golden's
provenance names it.

record_hf.py, record_next_token.py and record_vlm.py take a model as an HF
folder (config.json, tokenizer.json and one `model.safetensors` or a sharded
`model.safetensors.index.json` with its shards) or a `.gguf` file
(transformers' own GGUF loader dequantises it). describe_source() says which,
hashing every weight file (a sharded model changes when any shard does);
weights_provenance() writes the keys that identify the weights, by format
(src/golden/provenance/mod.rs reads them for its stale-golden check): the
keys of a single-file HF folder are the ones every golden had before GGUF
and sharded inputs were supported, so those goldens stay byte-identical.
hf_versions() is the `versions` entry of every HF golden.
"""
import json
import os
import platform
import sys

from golden_io import progress, sha256_file


def dist_version(name):
    """An installed distribution's version (a package without __version__)."""
    from importlib.metadata import version
    return version(name)


def describe_source(path, tool="record_hf.py"):
    """What MODEL is: an HF folder (single or sharded safetensors) or a GGUF
    file, with the sha256 of every file that holds weights. Exits with a
    clear message (prefixed `tool`) for anything else."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            sys.exit(f"{tool}: {path} is a file but not a .gguf; give an HF model folder or a .gguf file")
        from gguf import GGUFReader  # the pinned package transformers reads GGUFs with
        r = GGUFReader(path)

        def field(key):
            f = r.fields.get(key)
            if f is None:
                return None
            v = f.contents()
            return v.decode() if isinstance(v, bytes) else v
        progress(tool, f"hashing {path}")
        return {"kind": "gguf", "format": "gguf", "dir": os.path.dirname(os.path.abspath(path)),
                "file": os.path.basename(path), "sha256": sha256_file(path),
                "general_name": field("general.name"), "architecture": field("general.architecture"),
                "file_type": field("general.file_type"), "sharded": False}
    if not os.path.isdir(path):
        sys.exit(f"{tool}: model {path} does not exist")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        sys.exit(f"{tool}: {path} has no config.json (an HF model folder needs one; for a GGUF give the .gguf file)")
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        names, sharded = ["model.safetensors"], False
    elif os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in shards if not os.path.isfile(os.path.join(path, n))]
        if missing:
            sys.exit(f"{tool}: {index} names shards that are not in {path}: {missing}")
        names, sharded = ["model.safetensors.index.json"] + shards, True
    else:
        sys.exit(f"{tool}: {path} has neither model.safetensors nor model.safetensors.index.json "
                 "(only safetensors weights are supported)")
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok):
        sys.exit(f"{tool}: {path} has no tokenizer.json")
    progress(tool, f"hashing {len(names)} weight file(s) in {path}")
    # Every weight file is hashed: a sharded model changes when any shard does.
    return {"kind": "hf", "dir": path, "sharded": sharded,
            "files": {n: sha256_file(os.path.join(path, n)) for n in names},
            "tokenizer_sha256": sha256_file(tok)}


def folder_source(path):
    """describe_source's answer for a single-file HF folder whose files the
    caller has checked (record_vlm.py's tiny models): no GGUF, no shards."""
    return {"kind": "hf", "sharded": False,
            "files": {"model.safetensors": sha256_file(os.path.join(path, "model.safetensors"))},
            "tokenizer_sha256": sha256_file(os.path.join(path, "tokenizer.json"))}


def hf_versions(**more):
    """The `versions` entry of an HF golden: the interpreter and the pinned
    packages that computed it, plus `more`."""
    import numpy as np
    import safetensors
    import tokenizers
    import torch
    import transformers
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        **more,
    }


def weights_provenance(prov, source, hf_model_sha256=False):
    """Adds to `prov` (which has `versions`) the keys that identify the
    weights of `source` (describe_source's): for a GGUF `gguf_sha256`,
    `model` {format, file, sha256, general_name, architecture, file_type}
    and the gguf/accelerate versions transformers' GGUF loader ran with; for
    a sharded folder `model` {format: safetensors-sharded, files} and
    `tokenizer_sha256`; for a single file `model_sha256` (and
    `hf_model_sha256` as well where the next-token goldens write it) and
    `tokenizer_sha256`."""
    if source["kind"] == "gguf":
        prov["versions"]["gguf"] = dist_version("gguf")  # the pinned package has no __version__
        prov["versions"]["accelerate"] = dist_version("accelerate")
        prov["gguf_sha256"] = source["sha256"]
        prov["model"] = {k: source[k] for k in ("format", "file", "sha256", "general_name", "architecture",
                                                 "file_type")}
    elif source["sharded"]:
        prov["model"] = {"format": "safetensors-sharded", "files": source["files"]}
        prov["tokenizer_sha256"] = source["tokenizer_sha256"]
    else:
        prov["model_sha256"] = source["files"]["model.safetensors"]
        if hf_model_sha256:
            prov["hf_model_sha256"] = source["files"]["model.safetensors"]
        prov["tokenizer_sha256"] = source["tokenizer_sha256"]
    return prov
