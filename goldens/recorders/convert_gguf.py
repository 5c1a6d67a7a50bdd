#!/usr/bin/env python3
"""Convert an HF model folder to an F32 GGUF with llama.cpp's own converter.

usage: convert_gguf.py MODEL_DIR OUT.gguf [--model-name NAME] [--mmproj]

Runs vendor/llama.cpp/convert_hf_to_gguf.py from the pinned llama-cpp-python
sdist (fetched and extracted by build_llamacpp.py; no library build needed)
with that sdist's own gguf-py (gguf 0.19.0 for 0.3.36), offline, with
`--outtype f32`, and two patches, both about the tokenizer (the model
tensors are converted by the unpatched code):

  1. set_vocab: Qwen2/Qwen3, Llama and Phi-3 try sentencepiece first (an
     ImportError without the sentencepiece package) and Llama then tries the
     Llama-2 HF path. For a folder without a sentencepiece `tokenizer.model`
     (the tiny models: byte-level BPE) they go straight to the GPT-2/BPE
     path, `_set_vocab_gpt2()`, which is what the converter ends up using for
     real Qwen2/Qwen3 and Llama-3 models anyway.
  2. get_vocab_base_pre: the converter recognises a pre-tokenizer by hashing
     the token ids of a test string, and a locally trained vocabulary has an
     unknown hash (NotImplementedError). Only then, answer the pre-tokenizer
     make_model.py trained with, by model_type: Qwen2's regex for qwen2 and
     qwen3 ("qwen2"), Llama 3's for llama and phi3 ("llama-bpe"), Qwen2's
     for gemma3_text ("qwen2"). A real model's known hash is answered by the
     converter itself.

Vision-language models (Qwen2-VL, Qwen3-VL: model_type qwen2_vl, qwen3_vl;
make_vlm_model.py's tiny ones): without --mmproj the converter writes the
language model (GGUF architecture qwen2vl / qwen3vl, the vision tensors
dropped), with --mmproj the vision tower and merger (a CLIP GGUF, projector
type qwen2vl_merger / qwen3vl_merger, with the processor's image mean/std
from preprocessor_config.json), as llama.cpp's mtmd loads them. The same two
tokenizer patches apply to the language model (Qwen2VLModel.set_vocab also
tries sentencepiece first; make_vlm_model.py's tokenizer is make_model.py's
Qwen2 byte-level BPE, so the pre-tokenizer answered is "qwen2"); the mmproj
has no vocabulary. Tensors are the unpatched converter's.

Gemma 3 (model_type gemma3_text -> GGUF architecture gemma3) needs no
vocabulary patch: the converter's Gemma3Model.set_vocab reads a
sentencepiece tokenizer.model when there is one and otherwise takes the
tokenizer.json BPE vocabulary through the same `_set_vocab_gpt2()`. What the
converter does to a Gemma 3 and what llama.cpp then assumes is checked
after the conversion (check_gemma3, from the written file): every norm
weight (attn_norm, attn_q_norm, attn_k_norm, post_attention_norm, ffn_norm,
post_ffw_norm, output_norm) is HF's w + 1 computed in float32 (Gemma3RMSNorm
scales by 1 + w, llama.cpp's RMS norm by its weight), every other tensor is
HF's bit for bit, there is no output.weight (tied head), and the metadata
has HF's sliding_window, rope.freq_base (full_attention theta) and
rope.freq_base_swa (sliding_attention theta), and no
attention.sliding_window_pattern: llama.cpp then makes layer il sliding iff
il % 6 < 5, which must be HF's layer_types.

GGUF `general.name`: --model-name, else the config's `_model_name_or_path`
or `_name_or_path` (its last path part), else the folder name; a folder called `model` (the layout
goldens/<name>/model/, whose own name says nothing) is named after its parent,
and a parent `<family>-tiny` gives `touchstone-<family>-tiny`, the name the
committed tiny GGUFs carry. The output is byte-for-byte reproducible and does
not depend on where the folder is (beyond the name rule).
"""
import argparse
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

# model_type -> llama.cpp pre-tokenizer name of make_model.py's tokenizers
PRE_TOKENIZER = {"qwen2": "qwen2", "qwen3": "qwen2", "llama": "llama-bpe", "phi3": "llama-bpe", "gemma3_text": "qwen2",
                 "qwen2_vl": "qwen2", "qwen3_vl": "qwen2", "mixtral": "llama-bpe", "qwen2_moe": "qwen2",
                 "qwen3_moe": "qwen2", "gpt_oss": "qwen2", "deepseek_v3": "qwen2"}


def default_name(model_dir, cfg):
    """GGUF general.name when --model-name is not given (see the docstring)."""
    # transformers 4 saved `_name_or_path`; 5 saves `_model_name_or_path`
    # (for a model loaded from a GGUF: the GGUF's general.name).
    named = (cfg.get("_model_name_or_path") or cfg.get("_name_or_path") or "").rstrip("/")
    if named:
        return named.split("/")[-1]
    folder = os.path.basename(model_dir.rstrip("/"))
    if folder != "model":
        return folder
    parent = os.path.basename(os.path.dirname(model_dir.rstrip("/")))
    return f"touchstone-{parent}" if parent.endswith("-tiny") else parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--model-name", default=None, help="GGUF general.name (default: see the module docstring)")
    ap.add_argument("--mmproj", action="store_true",
                    help="a vision-language model's vision tower and projector (the converter's --mmproj)")
    args = ap.parse_args()
    model_dir, out = os.path.abspath(args.model_dir), os.path.abspath(args.out)
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        ap.error(f"{model_dir} has no config.json (give an HF model folder; a GGUF needs no conversion)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    model_type = cfg.get("model_type")
    name = args.model_name or default_name(model_dir, cfg)

    llama_dir = os.path.join(build_llamacpp.source_dir(), "vendor", "llama.cpp")
    # The converter and the gguf-py it was released with, never a pip gguf.
    sys.path.insert(0, llama_dir)
    sys.path.insert(1, os.path.join(llama_dir, "gguf-py"))
    for m in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
        del sys.modules[m]
    import gguf  # noqa: E402
    assert os.path.dirname(gguf.__file__).startswith(llama_dir), f"wrong gguf: {gguf.__file__}"
    import conversion.base as base  # noqa: E402
    import conversion.llama as llama  # noqa: E402
    import conversion.phi as phi  # noqa: E402
    import conversion.qwen as qwen  # noqa: E402
    import conversion.qwenvl as qwenvl  # noqa: E402

    # Patch 1: byte-level BPE vocab directly, when there is no sentencepiece model.
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.model")):
        for cls in (qwen.Qwen2Model, qwen.Qwen3Model, llama.LlamaModel, phi.Phi3MiniModel, qwenvl.Qwen2VLModel):
            cls.set_vocab = lambda self: self._set_vocab_gpt2()
    # Patch 3: the Qwen2-VL merger's mlp.2 in the name table of a shallow tower.
    if args.mmproj:
        orig_init = qwenvl.Qwen2VLVisionModel.__init__

        def init(self, *a, **kw):
            orig_init(self, *a, **kw)
            if self.block_count < 3:
                self.tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 3)
        qwenvl.Qwen2VLVisionModel.__init__ = init
    # Patch 2: the pre-tokenizer make_model.py trained with, for a vocabulary
    # whose hash the converter does not know.
    orig_pre = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return orig_pre(self, tokenizer)
        except NotImplementedError:
            if model_type not in PRE_TOKENIZER:
                raise
            return PRE_TOKENIZER[model_type]
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp"
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--outfile", tmp, "--model-name", name] + \
        (["--mmproj"] if args.mmproj else [])
    runpy.run_path(os.path.join(llama_dir, "convert_hf_to_gguf.py"), run_name="__main__")
    os.replace(tmp, out)
    if model_type == "gemma3_text":
        check_gemma3(gguf, model_dir, cfg, out)
    return 0


def check_gemma3(gguf, model_dir, cfg, path):
    """The converted Gemma 3 is HF's model as llama.cpp reads it (see the
    module docstring); raises AssertionError otherwise."""
    import numpy as np
    from safetensors.numpy import load_file
    hf = load_file(os.path.join(model_dir, "model.safetensors"))
    r = gguf.GGUFReader(path)
    got = {t.name: np.asarray(t.data) for t in r.tensors}
    n_layer = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, n_layer)
    seen, shifted = set(), 0
    for name, w in hf.items():
        gname = names.get_name(name, try_suffixes=(".weight",))
        assert gname is not None, f"{name}: no GGUF name"
        assert gname in got, f"{name} -> {gname}: not in the GGUF"
        g = got[gname].reshape(w.shape)
        if gname.endswith("norm.weight"):
            # Gemma3RMSNorm's 1 + w, added by the converter in float32.
            assert np.array_equal(g, (w.astype(np.float32) + np.float32(1.0)).astype(np.float32)), \
                f"{gname}: not HF's {name} + 1"
            assert not np.array_equal(g, w)
            shifted += 1
        else:
            assert np.array_equal(g, w), f"{gname}: not HF's {name} bit for bit"
        seen.add(gname)
    assert shifted == 6 * n_layer + 1, shifted
    assert set(got) == seen, f"GGUF tensors HF does not have: {sorted(set(got) - seen)}"
    assert "output.weight" not in got, "tied head written as output.weight"

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()
    arch = "gemma3"
    assert field("general.architecture") == arch
    assert field(f"{arch}.attention.sliding_window") == cfg["sliding_window"]
    assert field(f"{arch}.attention.sliding_window_pattern") is None
    rp = cfg["rope_parameters"]
    assert field(f"{arch}.rope.freq_base") == rp["full_attention"]["rope_theta"]
    assert field(f"{arch}.rope.freq_base_swa") == rp["sliding_attention"]["rope_theta"]
    assert field(f"{arch}.attention.key_length") == cfg["head_dim"] == field(f"{arch}.attention.value_length")
    assert field(f"{arch}.final_logit_softcapping") is None and cfg.get("final_logit_softcapping") is None
    # llama.cpp's default for gemma3 without a pattern key: set_swa_pattern(6).
    llama_cpp_types = ["sliding_attention" if il % 6 < 5 else "full_attention" for il in range(n_layer)]
    assert cfg["layer_types"] == llama_cpp_types, (cfg["layer_types"], llama_cpp_types)
    assert len(got["token_embd.weight"]) == cfg["vocab_size"], "token_embd trimmed"
    print(f"convert_gguf.py: gemma3 checked: {shifted} norm weights are HF's w + 1, every other tensor HF's "
          f"bit for bit; sliding_window {cfg['sliding_window']}, layers sliding iff il % 6 < 5, "
          f"rope bases {rp['full_attention']['rope_theta']} / {rp['sliding_attention']['rope_theta']} (swa)",
          file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
