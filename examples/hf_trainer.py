"""A transformers Trainer with ckptfmt's callback: SIGTERM commits checkpoint-N and exits 0,
every checkpoint-N is committed with a blake3 record, the resume takes the newest that verifies.

    python examples/hf_trainer.py --output runs/gpt2 --steps 20        # kill -TERM: commits, exits 0
    python examples/hf_trainer.py --output runs/gpt2 --steps 20        # resumes from resume_path()
    ckptfmt validate runs/gpt2 && ckptfmt ls runs/gpt2

A tiny GPT-2 built from a config (nothing downloaded), trained on random tokens on the CPU.
"""
import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ckptfmt.hf import Checkpointing, resume_path
from ckptfmt.run import Policy
from ckptfmt.torch.distributed import exit_worker, launched_by_torchrun


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every run (their own generator)."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = 64):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True, help="the Trainer's output_dir")
    ap.add_argument("--steps", type=int, default=20, help="max_steps")
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--keep-last", type=int, help="retention: the last K checkpoints (and the guards)")
    args = ap.parse_args()
    training = TrainingArguments(output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=4,
                                 save_steps=args.save_steps, save_total_limit=None, logging_steps=1,
                                 report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    ckpt = Checkpointing(retention=Policy(keep_last=args.keep_last) if args.keep_last else None)
    trainer = Trainer(model=tiny_gpt2(), args=training, train_dataset=Tokens(), callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=resume_path(args.output))
    if ckpt.stopped_by_signal:
        print(f"stopped by {ckpt.stopped_by_signal}: checkpoint-{trainer.state.global_step} committed",
              file=sys.stderr)
        return                          # what follows (evaluation, export) is for a finished run
    print(f"finished at step {trainer.state.global_step}", file=sys.stderr)


if __name__ == "__main__":
    main()
    if launched_by_torchrun():          # a gloo rank can abort in interpreter finalization: not through it
        exit_worker(0)
