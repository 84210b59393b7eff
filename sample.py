"""Generate text from a trained run (its newest checkpoint, whatever layout saved it) or from OpenAI's GPT-2.

    python sample.py --out_dir runs/demo --start "ROMEO:" --num_samples 3 --max_new_tokens 200
    python sample.py --init_from gpt2 --start FILE:prompt.txt --device cuda      # needs the HF hub

One process, CPU or GPU. The checkpoint's shards are assembled into a single-process GPT by
checkpoint.load_model. Text is GPT-2 BPE, or the characters of a character-level dataset when the run trained
on one (its meta.json, data/chars.py: `--dataset shakespeare_char`). Sampling is ancestral with temperature and
top-k, drawn from a torch.Generator seeded by --seed, so the same command prints the same text (on the same device
and torch version).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from checkpoints import checkpoint
from data.chars import CharsError, CharVocab, run_chars
from data.tokenizer import GPT2_N_VOCAB, get_gpt2_encoding
from model.gpt import GPT
from runtime.device import pick_device
from trainer.config import HF_MODELS, Parser, UsageError, error_line, fetch_hf_weights


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="sample.py", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--out_dir", default=None, help="a training run: sample from its newest complete checkpoint")
    a("--checkpoint", default=None, help="a checkpoint directory (default: the newest in --out_dir)")
    a(
        "--init_from",
        choices=["resume", *HF_MODELS],
        default="resume",
        help="resume (a checkpoint, default) or OpenAI's weights from the Hugging Face hub",
    )
    a("--start", default="\n", help="the prompt, or FILE:path to read it from a file")
    a("--num_samples", type=int, default=3)
    a("--max_new_tokens", type=int, default=200)
    a("--temperature", type=float, default=0.8, help="0 means greedy")
    a("--top_k", type=int, default=200, help="sample from the k most likely tokens (0: all)")
    a("--seed", type=int, default=1337)
    a("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return p.parse_args(argv)


@dataclass(frozen=True)
class Codec:
    """Text <-> token ids for one model: ids >= `vocab` (its padding rows) are never drawn."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab: int


def bpe_codec() -> Codec:
    """GPT-2's BPE (an empty prompt starts from <|endoftext|>)."""
    enc = get_gpt2_encoding()
    return Codec(
        lambda text: enc.encode(text, allowed_special={"<|endoftext|>"}) or [enc.eot_token], enc.decode, GPT2_N_VOCAB
    )


def char_codec(chars: CharVocab) -> Codec:
    """A character-level dataset's characters (an empty prompt starts from a newline, or the first character)."""

    def encode(text: str) -> list[int]:
        unknown = sorted(set(text) - set(chars.chars))
        if unknown:
            raise UsageError(
                f"--start holds {''.join(unknown)!r}, not among the {len(chars)} characters the model "
                f"was trained on: {chars.chars!r}"
            )
        return chars.encode(text) or chars.encode("\n" if "\n" in chars.chars else chars.chars[0])

    return Codec(encode, chars.decode, len(chars))


def load(args: argparse.Namespace, device: torch.device) -> tuple[GPT, Codec]:
    """The model (a checkpoint's, or OpenAI's) and the text it reads and writes."""
    if args.init_from != "resume":
        return GPT.from_hf_state_dict(fetch_hf_weights(args.init_from)).to(device), bpe_codec()
    path = args.checkpoint
    if path is None:
        if args.out_dir is None:
            raise UsageError("pass --out_dir RUN (or --checkpoint DIR, or --init_from gpt2)")
        path = checkpoint.newest_intact(args.out_dir, lambda line: sys.stderr.write(f"sample.py: {line}\n"))
        if path is None:
            raise UsageError(
                f"no intact checkpoint in {os.path.join(args.out_dir, checkpoint.SUBDIR)}; "
                f"train without --no_checkpoint"
            )
    try:
        chars = run_chars(checkpoint.verify(path))
        return checkpoint.load_model(path, device), char_codec(chars) if chars else bpe_codec()
    except (checkpoint.CheckpointError, CharsError) as e:
        raise UsageError(str(e)) from None


def prompt_text(start: str) -> str:
    if start.startswith("FILE:"):
        try:
            with open(start[5:], encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise UsageError(f"--start {start}: {e.strerror}") from None
    return start


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
    vocab: int = GPT2_N_VOCAB,
) -> torch.Tensor:
    """Append max_new_tokens tokens to idx (B, T). Ids >= vocab (the padding rows) are never drawn."""
    for _ in range(max_new_tokens):
        context = idx[:, -model.config.block_size :]
        logits, _ = model(context)
        logits = logits[:, -1, :vocab].float()  # (B, vocab)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if 0 < top_k < logits.size(-1):
                kth = torch.topk(logits, top_k).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.num_samples < 1 or args.max_new_tokens < 0:
            raise UsageError("--num_samples must be >= 1 and --max_new_tokens >= 0")
        try:
            device = pick_device(args.device)
        except ValueError as e:
            raise UsageError(str(e)) from None
        text = prompt_text(args.start)
        model, codec = load(args, device)
        ids = codec.encode(text)
    except UsageError as e:
        error_line("sample.py", e)
        return 2
    model.eval()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.tensor(ids, dtype=torch.long, device=device)[None]
    for _ in range(args.num_samples):
        y = generate(model, x, args.max_new_tokens, args.temperature, args.top_k, generator, codec.vocab)
        print(codec.decode(y[0].tolist()))
        print("---------------", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
