#!/usr/bin/env python3
"""Write an HF model folder (safetensors, float32) from a GGUF, with transformers' own GGUF loader.

usage: gguf_to_hf.py MODEL.gguf OUT_DIR [--max-shard-size SIZE]

Loads the GGUF as record_hf.py does (`from_pretrained(dir, gguf_file=name)`,
weights dequantised to float32 by the pinned `gguf` package, tokenizer and
config from the GGUF) and saves it with `save_pretrained(safe_serialization=
True)`: config.json, generation_config.json, model.safetensors (or, with
--max-shard-size, e.g. 800MB, shards plus model.safetensors.index.json),
tokenizer.json and tokenizer_config.json. The GGUF quantisation entry of the
config is dropped: the folder holds plain float32 weights.

What it is for: `goldens regen` and the recorders on an HF folder of a real
model, single-file or sharded, made from the GGUF that is cached anyway (no
Hub access here). The folder has the same weights as the GGUF after
dequantisation, so HF goldens recorded from it and from the GGUF agree.
OUT_DIR must not exist yet (nothing is overwritten) and should lie outside
the checkout (a 0.5B model is 2 GB in float32), e.g. under
$TOUCHSTONE_CACHE/work/.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--max-shard-size", default=None, help="e.g. 800MB: write shards of at most this size")
    args = ap.parse_args()
    if not os.path.isfile(args.gguf) or not args.gguf.endswith(".gguf"):
        ap.error(f"{args.gguf} is not a .gguf file")
    if os.path.exists(args.out_dir):
        ap.error(f"{args.out_dir} exists; give a new folder (nothing is overwritten)")
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    d, f = os.path.dirname(os.path.abspath(args.gguf)), os.path.basename(args.gguf)
    print(f"gguf_to_hf.py: loading {args.gguf}", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # The loaded weights are plain float32 tensors; a saved `quantization_config`
    # would make transformers look for the GGUF again when loading the folder.
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.hf_quantizer = None
    kw = {"safe_serialization": True}
    if args.max_shard_size:
        kw["max_shard_size"] = args.max_shard_size
    tmp = args.out_dir + ".tmp"
    if os.path.exists(tmp):
        ap.error(f"{tmp} exists (an interrupted run?); remove it first")
    print(f"gguf_to_hf.py: saving to {args.out_dir}", file=sys.stderr, flush=True)
    model.save_pretrained(tmp, **kw)
    tok.save_pretrained(tmp)
    os.replace(tmp, args.out_dir)
    files = sorted(os.listdir(args.out_dir))
    print(json.dumps({"out": args.out_dir, "files": files,
                      "bytes": sum(os.path.getsize(os.path.join(args.out_dir, n)) for n in files)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
