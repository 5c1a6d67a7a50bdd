#!/usr/bin/env python3
"""Convert a tiny HF model folder to an F32 GGUF with llama.cpp's own converter.

usage: convert_gguf.py MODEL_DIR OUT.gguf

Runs vendor/llama.cpp/convert_hf_to_gguf.py from the pinned llama-cpp-python
sdist (fetched and extracted by build_llamacpp.py; no library build needed)
with that sdist's own gguf-py (gguf 0.19.0 for 0.3.36), offline, with
`--outtype f32`, and exactly two patches, both about the tokenizer (the
model tensors are converted by the unpatched code):

  1. set_vocab: Qwen2Model and LlamaModel try sentencepiece first (an
     ImportError without the sentencepiece package; our tokenizers are
     byte-level BPE anyway) and LlamaModel then tries the Llama-2 HF path.
     Both go straight to the GPT-2/BPE path, `_set_vocab_gpt2()`, which is
     what the converter ends up using for real Qwen2 and Llama-3 models.
  2. get_vocab_base_pre: the converter recognises a pre-tokenizer by hashing
     the token ids of a test string, and a locally trained vocabulary has an
     unknown hash (NotImplementedError). make_model.py uses exactly Qwen2's
     pre-tokenizer regex for qwen2 and Llama 3's for llama, which llama.cpp
     calls "qwen2" and "llama-bpe": answer that, by the config's model_type.

`--model-name` is fixed per model_type so the GGUF does not depend on the
folder name. The output is byte-for-byte reproducible.
"""
import json
import os
import runpy
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.dont_write_bytecode = True

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_llamacpp  # noqa: E402

# model_type -> llama.cpp pre-tokenizer name; model_type -> GGUF general.name
PRE_TOKENIZER = {"qwen2": "qwen2", "llama": "llama-bpe"}
MODEL_NAME = {"qwen2": "touchstone-qwen2-tiny", "llama": "touchstone-llama-tiny"}


def main():
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 2 if len(sys.argv) != 2 else 0
    model_dir, out = (os.path.abspath(p) for p in sys.argv[1:3])
    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    if model_type not in PRE_TOKENIZER:
        sys.exit(f"convert_gguf.py: unsupported model_type {model_type!r} (known: {sorted(PRE_TOKENIZER)})")

    llama_dir = os.path.join(build_llamacpp.source_dir(), "vendor", "llama.cpp")
    # The converter and the gguf-py it was released with, never a pip gguf.
    sys.path.insert(0, llama_dir)
    sys.path.insert(1, os.path.join(llama_dir, "gguf-py"))
    import gguf  # noqa: E402
    assert os.path.dirname(gguf.__file__).startswith(llama_dir), f"wrong gguf: {gguf.__file__}"
    import conversion.base as base  # noqa: E402
    import conversion.llama as llama  # noqa: E402
    import conversion.qwen as qwen  # noqa: E402

    # Patch 1: byte-level BPE vocab directly.
    qwen.Qwen2Model.set_vocab = lambda self: self._set_vocab_gpt2()
    llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
    # Patch 2: the pre-tokenizer make_model.py trained with.
    pre = PRE_TOKENIZER[model_type]
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre

    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp"
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--outfile", tmp,
                "--model-name", MODEL_NAME[model_type]]
    runpy.run_path(os.path.join(llama_dir, "convert_hf_to_gguf.py"), run_name="__main__")
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
