"""Export a run's checkpoint as one Hugging Face GPT-2 safetensors file (plus its config.json).

    python export.py --out_dir runs/demo                       # -> runs/demo/hf/model.safetensors + config.json
    python export.py --out_dir runs/demo --output gpt.safetensors

The checkpoint (newest in --out_dir, or --checkpoint DIR; saved in any layout) is assembled into one
model and written with `GPT.to_hf_state_dict`: HF names, Conv1D (in, out) weights, fused c_attn, and the
vocab cut back to GPT-2's 50257 rows (the padding rows are dropped). A model trained on characters
(`--dataset shakespeare_char`) keeps one row per character and gets the dataset's meta.json beside it:
the characters, id i the i-th (data/chars.py), for whoever decodes its output. `lm_head.weight` is left out: it is
tied to `transformer.wte.weight`, safetensors refuses shared tensors, and transformers re-ties it on
load (as its own save_pretrained does). The directory then loads with
`GPT2LMHeadModel.from_pretrained(dir)`, and `GPT.from_hf_state_dict` reads the file back.
"""

from __future__ import annotations

import json
import os
import sys

from checkpoints import checkpoint
from data.chars import run_chars
from data.tokenizer import GPT2_N_VOCAB
from trainer.config import Parser, UsageError, error_line


def hf_config(config, hf_vocab: int, bpe: bool = True) -> dict:
    """transformers' GPT2Config fields for our model (GELU-tanh is HF's "gelu_new"); `bpe`: GPT-2's tokens, with
    <|endoftext|> (50256) as BOS and EOS (a character vocabulary has neither)."""
    eot = 50256 if bpe else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": hf_vocab,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


def export(path: str, output: str) -> str:
    """Write checkpoint `path` to `output` (safetensors) and config.json beside it; returns output."""
    from safetensors.torch import save_file

    chars = run_chars(checkpoint.read_manifest(path))  # None: GPT-2 BPE
    model = checkpoint.load_model(path)
    config = model.config
    if not config.bias:
        raise ValueError("HF GPT-2 has biases everywhere; a --bias-free model cannot be exported to it")
    if chars:
        hf_vocab = len(chars)  # one row per character: the padding rows dropped
    else:
        hf_vocab = GPT2_N_VOCAB if config.vocab_size == 50304 else config.vocab_size  # drop GPT-2's padding
    sd = model.to_hf_state_dict(hf_vocab)
    del sd["lm_head.weight"]  # tied to transformer.wte.weight
    sd = {k: v.detach().contiguous() for k, v in sd.items()}
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    save_file(sd, output, metadata={"format": "pt"})
    out_dir = os.path.dirname(os.path.abspath(output))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(config, hf_vocab, bpe=chars is None), f, indent=2)
    if chars:
        chars.save(out_dir)
    return output


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="export.py", description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", required=True, help="a training run with checkpoints")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the newest in --out_dir)")
    p.add_argument("--output", default=None, help="the .safetensors file (default: <out_dir>/hf/model.safetensors)")
    try:
        args = p.parse_args(argv)
        path = args.checkpoint or checkpoint.newest_intact(
            args.out_dir, lambda line: sys.stderr.write(f"export.py: {line}\n")
        )
        if path is None:
            raise UsageError(f"no intact checkpoint in {os.path.join(args.out_dir, checkpoint.SUBDIR)}")
        manifest = checkpoint.verify(path)
        experts = checkpoint.model_config(manifest).moe_num_experts
        if experts:
            raise UsageError(
                f"{path} holds a mixture-of-experts model ({experts} experts per MoE layer): GPT-2's "
                f"Hugging Face class (GPT2LMHeadModel) has no experts to load them into"
            )
        chars = run_chars(manifest)  # a character-level run's characters are there, before any work
        output = args.output or os.path.join(args.out_dir, "hf", "model.safetensors")
        export(path, output)
    except (UsageError, checkpoint.CheckpointError, ValueError) as e:
        error_line("export.py", e)
        return 2
    print(f"exported {path} -> {output} (+ config.json{', meta.json: the characters' if chars else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
