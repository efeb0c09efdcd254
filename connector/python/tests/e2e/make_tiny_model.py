#!/usr/bin/env python3
"""Write a tiny, deterministic model + tokenizer that vLLM loads offline.

Usage:  python make_tiny_model.py OUT_DIR [--dtype float32|bfloat16]
            [--arch llama|mistral|gemma3|nemotron_h] [--layer-types s,f,...]
            [--sliding-window N] [--hidden N] [--intermediate N]
            [--layers N] [--heads N] [--kv-heads N] [--head-dim N] [--max-pos N]

--arch llama (the default) writes a LlamaForCausalLM; the shape options
default to the tiny model (hidden 128, 2 layers), and with none of them
given the output is byte-identical to earlier versions. Benchmarks use them
for a model large enough to make prefill cost measurable (bench/vllm) or
for smaller KV pages (--kv-heads 1).

--arch gemma3 writes a Gemma3ForCausalLM (text only) whose layers follow
--layer-types (s: sliding-window attention of --sliding-window tokens, f:
full attention; default Gemma 3's 5:1 pattern, s,s,s,s,s,f, window 64):
with vLLM's hybrid memory allocator each kind gets KV cache groups of its
own. --arch mistral writes a MistralForCausalLM with the Llama's shape
(--layers and the other shape options) and per-layer windows as Ministral
8B has them (--layer-types, default s,f alternating): the Llama's compute
but for the windows, for benchmarks against it. --arch nemotron_h writes a NemotronHForCausalLM, a hybrid of Mamba-2
and attention layers (--layer-types m,a,-,m,a,-: mamba, attention, MLP).

Needs: torch, transformers, tokenizers, safetensors (all present in the
.venv-vllm made by connector/python/scripts/install-vllm.sh). No network.

The model has fixed-seed random weights, so its output is gibberish but is
reproducible. Same inputs -> byte-identical files on every run (checked by
``--check``, which builds twice and compares SHA-256 of every file).

Shape choices are dictated by vLLM's CPU attention backend (CPU_ATTN):
head_dim must be one of 32, 64, 80, ... so hidden=128 with 4 heads -> 32.

Tokenizer: byte-level BPE with no merges: ids 0..3 are specials
(<pad>, <s>, </s>, <unk>), ids 4..259 are the 256 bytes. Every UTF-8 byte of
a prompt is exactly one token, and encode() prepends <s>, so a prompt of n
bytes is n+1 tokens. This makes block-count arithmetic in tests trivial.
Random weights may emit </s> early: use SamplingParams(ignore_eos=True).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
VOCAB_SIZE = len(SPECIALS) + 256  # 260
SEED = 1234

CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def build_tokenizer(out_dir: str, config: dict | None = None) -> None:
    config = config or CONFIG
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins
    # alphabet() is a set in some versions: order it by the byte it stands for.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    assert set(byte_chars) == set(b2u.values())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b in range(256):
        vocab[b2u[b]] = len(SPECIALS) + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=config["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)


def build_model(out_dir: str, dtype: str, config: dict | None = None, arch: str = "llama") -> None:
    import torch
    import transformers

    torch.manual_seed(SEED)
    config_cls, model_cls = ARCHS[arch]
    cfg = getattr(transformers, config_cls)(**(config or CONFIG))
    cfg.architectures = [model_cls]
    with torch.no_grad():
        model = getattr(transformers, model_cls)(cfg)
        # Re-draw every tensor from one generator in sorted-name order, so the
        # weights do not depend on transformers' init code or module order.
        gen = torch.Generator().manual_seed(SEED)
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + weight).
                p.fill_(0.0 if arch == "gemma3" else 1.0)
            elif name.endswith("A_log"):  # Mamba: decays exp(-A) in (0, 1)
                p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32)).reshape(p.shape))
            elif name.endswith((".D", "dt_bias")):
                p.fill_(1.0)
            else:
                # std 2/sqrt(fan_in): large enough that greedy output varies.
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / p.shape[-1] ** 0.5))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)


# --arch -> (transformers config class, model class).
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
}
LAYER_TYPES = {
    "mistral": {"s": "sliding_attention", "f": "full_attention"},
    "gemma3": {"s": "sliding_attention", "f": "full_attention"},
    "nemotron_h": {"m": "mamba", "a": "attention", "-": "mlp"},
}
DEFAULT_LAYER_TYPES = {"gemma3": "s,s,s,s,s,f", "nemotron_h": "m,a,-,m,a,-"}


def arch_config(arch: str, config: dict, layer_types: str | None, window: int) -> dict:
    """The transformers config of a tiny model of another architecture
    (same vocabulary and shapes as config where they apply)."""
    if arch == "llama":
        return config
    if arch == "mistral":
        n = config["num_hidden_layers"]
        kinds = [LAYER_TYPES[arch][k] for k in (layer_types or ",".join("sf"[i % 2] for i in range(n))).split(",")]
        if len(kinds) != n:
            raise ValueError("--layer-types: %d kinds for %d layers" % (len(kinds), n))
        return dict(config, layer_types=kinds, sliding_window=window)
    kinds = [LAYER_TYPES[arch][k] for k in (layer_types or DEFAULT_LAYER_TYPES[arch]).split(",")]
    out = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings")}
    out.update(
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "gemma3":
        out.update(
            num_hidden_layers=len(kinds),
            layer_types=kinds,
            sliding_window=window,
            query_pre_attn_scalar=config["head_dim"],
        )
    else:
        out.update(
            layers_block_type=kinds,
            mamba_num_heads=4,
            mamba_head_dim=64,
            n_groups=1,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=64,
        )
    return out


def normalize(out_dir: str) -> None:
    """Drop run-dependent fields so files are byte-identical across runs."""
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            data = json.load(f)
        data.pop("transformers_version", None)
        with open(path, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")


# CLI option -> CONFIG key, for models other than the default tiny one.
SHAPE_OPTIONS = {
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "max_pos": "max_position_embeddings",
}


def make(out_dir: str, dtype: str = "float32", config: dict | None = None, arch: str = "llama") -> None:
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer(out_dir, config)
    build_model(out_dir, dtype, config, arch)
    normalize(out_dir)


def digest(out_dir: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--check", action="store_true", help="build twice, compare hashes")
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    ap.add_argument("--layer-types", help="gemma3: s,f,... ; nemotron_h: m,a,-,... (see the module doc)")
    ap.add_argument("--sliding-window", type=int, default=64, help="gemma3, mistral: tokens (default 64)")
    for opt, key in SHAPE_OPTIONS.items():
        ap.add_argument(
            "--" + opt.replace("_", "-"), type=int, default=CONFIG[key], help="%s (default %d)" % (key, CONFIG[key])
        )
    args = ap.parse_args()
    config = dict(CONFIG)
    for opt, key in SHAPE_OPTIONS.items():
        config[key] = getattr(args, opt)
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        ap.error("--heads must be a multiple of --kv-heads")
    try:
        model_config = arch_config(args.arch, config, args.layer_types, args.sliding_window)
    except KeyError as e:
        ap.error("--layer-types: unknown kind %s for --arch %s" % (e, args.arch))
    except ValueError as e:
        ap.error(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    make(args.out_dir, args.dtype, model_config, args.arch)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            make(tmp, args.dtype, model_config, args.arch)
            a, b = digest(args.out_dir), digest(tmp)
            if a != b:
                print(f"NOT deterministic:\n{a}\n{b}", file=sys.stderr)
                return 1
    for name, h in digest(args.out_dir).items():
        print(f"{h}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
