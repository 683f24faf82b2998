"""FIRE, ReDo and DASH in a Hugging Face ``transformers.Trainer``: fine-tune a small GPT-2 (random init).

    pip install -e '.[hf]'
    python examples/hf_trainer.py                  # 200 steps, a few minutes on a CPU
    python examples/hf_trainer.py --steps 4        # a smoke run (the tests run it)

FIRE makes the attention weights (GPT-2's fused Q/K/V as three blocks) isometric at the middle step,
ReDo logs the dormant fraction of the MLP units, DASH shrinks rows that follow their gradient. Their
metrics land in ``trainer.state.log_history`` (and any ``report_to`` logger); their state is saved
in every checkpoint, so ``trainer.train(resume_from_checkpoint=True)`` continues the schedules.
"""
import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from plasticity_callbacks import DASHPeriodic, FIREReinit, ReDoMonitor, Schedule
from plasticity_callbacks.integrations.hf import HFTrainerCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--output-dir", default=None, help="checkpoints and logs (default: a temporary folder)")
    args = parser.parse_args()
    steps = args.steps
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_")

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
    text = open(__file__, "rb").read()  # bytes as tokens: no tokenizer to download
    data = [{"input_ids": (ids := torch.tensor(list(text[i:i + 64]))), "labels": ids}
            for i in range(0, len(text) - 64, 32)]
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-3, logging_steps=max(1, steps // 10), save_steps=max(2, steps // 2),
                             report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(HFTrainerCallback(
        FIREReinit(schedule=Schedule(steps=[steps // 2]), selection={"scope": "attention"}),
        ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=max(1, steps // 4)),
        DASHPeriodic(schedule=Schedule(every_n_steps=max(1, steps // 4))),
        trainer=trainer))
    trainer.train()
    for entry in trainer.state.log_history:
        shown = {k: round(v, 4) for k, v in entry.items() if k.split("/")[0] in ("fire", "redo", "dash_periodic")
                 and k.count("/") == 1 or k in ("loss", "step")}
        if len(shown) > 1:
            print(shown)
    print(f"checkpoints in {output_dir}")


if __name__ == "__main__":
    main()
