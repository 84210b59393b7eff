"""train.py --config FILE.toml (trainer/config_file.py): the file supplies the flags, the command line overrides it,
every
run writes its own OUT_DIR/config.toml, and `--config OUT_DIR/config.toml --out_dir NEW` replays the run bit for bit.
A bad file is one line naming the key, exit 2. The shipped configs/ pass every check of their layout."""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import unittest

import pytest
import torch

from model.gpt import make_config
from tests.harness import ROOT, evals_of, expect_train_error_in_process, forked, make_token_bins, rank0_only, steps_of
from trainer import config, config_file


def write(directory: str, text: str, name: str = "c.toml") -> str:
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


class TestReadAndWrite(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def test_file_then_command_line(self):
        path = write(
            self.tmp.name,
            'model = "tiny"\nlr = 1\nmax_steps = 7\nsequence_parallel = true\npp_layers_per_stage = "1,1"\n',
        )
        args = config.parse_args(["--config", path, "--max_steps", "9"])
        self.assertEqual(
            (args.model, args.lr, args.max_steps, args.sequence_parallel, args.pp_layers_per_stage),
            ("tiny", 1.0, 9, True, "1,1"),
        )
        self.assertIsInstance(args.lr, float)  # an integer for a float flag: the float the command line would give
        self.assertEqual(config.parse_args(["--conf", path]).max_steps, 7)  # argparse's abbreviation reads it too

    def test_what_a_run_writes_reads_back_to_the_same_flags(self):
        """dumps -> read gives every flag back, of its type (floats to the bit, strings with quotes and
        backslashes); flags without a value (None) are left out and so stay None."""
        args = config.parse_args(
            [
                "--model",
                "tiny",
                "--lr",
                "3e-3",
                "--weight_decay",
                "1e-05",
                "--timeout",
                "0.1",
                "--dataset",
                'a "quoted" \\ path/ü',
                "--gradient_clipping",
                "--pp_layers_per_stage",
                "2,3",
                "--out_dir",
                "runs/x",
            ]
        )
        parser = config.train_parser()
        text = config_file.dumps(args, parser)
        self.assertNotIn("n_layer", text)  # None: not written
        back = config.parse_args(["--config", write(self.tmp.name, text)])
        want = {k: v for k, v in vars(args).items() if k not in config_file.NOT_IN_FILE}
        got = {k: getattr(back, k) for k in want}
        self.assertEqual(got, want)
        self.assertEqual({k: type(v) for k, v in got.items()}, {k: type(v) for k, v in want.items()})

    def test_a_float_that_needs_every_digit_replays_to_the_bit(self):
        """A run's <out_dir>/config.toml holds each float to the bit: --lr 0.00123456789 (11 significant digits)
        and 0.1 + 0.2 (17: 0.30000000000000004) come back equal through --config, not rounded to a shorter
        decimal (which would silently replay another run)."""
        out = os.path.join(self.tmp.name, "run")
        argv = ["--model", "tiny", "--lr", "0.00123456789", "--weight_decay", repr(0.1 + 0.2), "--out_dir", out]
        args = config.parse_args(argv)
        path = config_file.write(args, config.train_parser())  # what train.py writes
        self.assertEqual(path, os.path.join(out, "config.toml"))
        back = config.parse_args(["--config", path])
        self.assertEqual((back.lr, back.weight_decay), (0.00123456789, 0.30000000000000004))
        self.assertNotEqual(back.weight_decay, 0.3)

    def test_bad_files_are_one_line_naming_the_key(self):
        data = make_token_bins(os.path.join(self.tmp.name, "data"), n_train=2000, n_val=500)
        cases = {
            "lr = 1e-3\nmicro_batch_siz = 4\n": "unknown key 'micro_batch_siz': not a train.py flag (did you "
            "mean 'micro_batch_size'?)",
            'max_steps = "10"\n': "key 'max_steps' must be an integer, got str \"10\"",
            "max_steps = 2.5\n": "key 'max_steps' must be an integer, got float 2.5",
            "max_steps = true\n": "key 'max_steps' must be an integer, got bool true",
            "gradient_clipping = 1\n": "key 'gradient_clipping' must be a boolean (true or false), got int 1",
            'lr = "fast"\n': "key 'lr' must be a number, got str \"fast\"",
            'implementation = "jax"\n': "key 'implementation' must be one of custom, pytorch, got 'jax'",
            "[model]\nn_layer = 2\n": "key 'model' must be a string, got dict",
            'config = "other.toml"\n': "unknown key 'config'",
            "resume = true\n": "unknown key 'resume'",
            "lr = \n": "not valid TOML",
        }
        for i, (text, needle) in enumerate(cases.items()):
            with self.subTest(text):
                path = write(self.tmp.name, text, f"bad{i}.toml")
                expect_train_error_in_process(
                    self,
                    ["--config", path, "--model", "tiny", "--dataset", data],
                    f"--config {path}: {needle}",
                    os.path.join(self.tmp.name, f"out{i}"),
                )
        missing = os.path.join(self.tmp.name, "missing.toml")
        expect_train_error_in_process(
            self, ["--config", missing], f"--config {missing}: no such file", os.path.join(self.tmp.name, "out")
        )


# What config.toml may leave out, and why: a flag here does not change the run's bits (losses, evals, checkpoints'
# contents). Every other flag of train_parser() must be carried, so a new flag is carried unless added here.
RUN_FREE = {
    "help": "prints the usage and exits: never part of a run",
    "config": "where the flags came from; the file holds the flags themselves",
    "out_dir": "where the run writes; a replay names its own (--out_dir NEW)",
    "overwrite": "what to do with an old out_dir, not what to compute",
    "resume": "continue from out_dir's checkpoint: the same run's bits either way",
}


def off_default(action, i: int):
    """A value of `action`'s kind that is not its default (None when the test cannot make one: a new kind of
    flag). Floats need all 17 digits (1 / (7 + i)), so a shortened float is seen too."""
    if isinstance(action, argparse._StoreTrueAction):
        return True
    if action.nargs is not None or not isinstance(action, argparse._StoreAction):
        return None
    if action.choices is not None:
        return next(c for c in action.choices if c != action.default)
    if action.type is int:
        return (action.default or 0) + 3 + i
    if action.type is float:
        return 1 / (7 + i)
    if action.type is None:
        return f"value-of-{action.dest}"
    return None


class TestEveryFlagIsInTheFile(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def test_config_toml_carries_every_flag_that_changes_the_run(self):
        """Every flag of train_parser() but RUN_FREE, each set off its default on the command line, comes back
        equal from the run's <out_dir>/config.toml through --config alone. The flags are the parser's, not a list
        here: a new flag is held the day it is added, and one the file drops (the seed, say) fails."""
        parser = config.train_parser()
        actions = {a.dest: a for a in parser._actions}
        self.assertLessEqual(set(RUN_FREE), set(actions))  # no stale excuse
        values = {d: off_default(a, i) for i, (d, a) in enumerate(actions.items()) if d not in RUN_FREE}
        self.assertEqual([d for d, v in values.items() if v is None], [], "a flag this test cannot set: teach it")
        argv = ["--out_dir", os.path.join(self.tmp.name, "run")]
        for dest, value in values.items():
            flag = actions[dest].option_strings[0]
            argv += [flag] if value is True else [flag, str(value)]
        args = config.parse_args(argv)
        self.assertEqual({d: getattr(args, d) for d in values}, values)
        back = config.parse_args(["--config", config_file.write(args, parser)])
        got = {d: getattr(back, d) for d in values}
        self.assertEqual([d for d in values if got[d] != values[d]], [], "flags config.toml does not carry")


class TestShippedConfigs(unittest.TestCase):
    def test_every_config_passes_its_layouts_checks(self):
        """Each configs/*.toml parses and passes check_layout at its world size (dp x tp x pp x cp), as torchrun
        --nproc_per_node=that would start it (on this CPU: no data, no GPU needed)."""
        paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))
        self.assertEqual([os.path.basename(p) for p in paths], ["gpt2-124m.toml", "quickstart.toml"])
        for path in paths:
            with self.subTest(path):
                args = config.parse_args(["--config", path])
                world = (
                    args.data_parallel_size
                    * args.tensor_parallel_size
                    * args.pipeline_parallel_size
                    * args.context_parallel_size
                )
                dims, *_ = config.check_layout(args, world, torch.device("cpu"))
                self.assertEqual(dims.world_size, world)

    def test_every_config_trains_every_position_it_samples(self):
        """sample.py feeds the model up to block_size positions of context; positions past seq_len were never
        trained, and a sample turns to noise there ("thththlllll" after 64 characters with tiny's 1024). So a shipped
        config's block_size is its seq_len."""
        for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml"))):
            with self.subTest(path):
                args = config.parse_args(["--config", path])
                self.assertEqual(make_config(args.model, block_size=args.block_size).block_size, args.seq_len)

    def test_the_readme_quick_start_is_this_config(self):
        """README's quick start trains configs/quickstart.toml (character-level Shakespeare) and samples its out_dir."""
        args = config.parse_args(["--config", os.path.join(ROOT, "configs", "quickstart.toml")])
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        self.assertEqual(args.dataset, "shakespeare_char")
        for command in (
            "torchrun --standalone --nproc_per_node=2 train.py --config configs/quickstart.toml",
            f"python sample.py --out_dir {args.out_dir} ",
        ):
            self.assertTrue(command in readme, f"README.md's quick start lacks {command!r}")
        self.assertEqual(args.data_parallel_size, 2)

    def test_the_124m_recipe_is_build_nanogpts(self):
        args = config.parse_args(["--config", os.path.join(ROOT, "configs", "gpt2-124m.toml")])
        self.assertEqual(
            (args.model, args.dataset, args.total_batch_size, args.seq_len), ("gpt2", "fineweb", 524288, 1024)
        )
        self.assertEqual(args.total_batch_size * args.max_steps // 10**6, 9999)  # 10B tokens: sample-10BT once
        self.assertEqual(
            (args.lr, args.warmup_steps, args.weight_decay, args.gradient_clipping), (6e-4, 715, 0.1, True)
        )
        self.assertEqual(args.micro_batch_size * args.seq_len * args.data_parallel_size, args.total_batch_size)
        self.assertEqual((args.dtype, args.compile), ("bfloat16", True))  # the planner's efficiency is a compiled run's


STEPS = 6
RUN = [
    "--model",
    "tiny",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "64",
    "--total_batch_size",
    "512",
    "--max_steps",
    str(STEPS),
    "--eval_interval",
    "3",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
    "--tensor_parallel_size",
    "2",
    "--sequence_parallel",
    "--seed",
    "7",
    "--no_checkpoint",
]


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestReplay(unittest.TestCase):
    """A TP x 2 (sequence parallel) run from the command line, then its config.toml replayed into another out_dir."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        data = make_token_bins(os.path.join(d, "data"))
        cls.first, cls.replay = os.path.join(d, "first"), os.path.join(d, "replay")
        for args in (
            [*RUN, "--dataset", data, "--out_dir", cls.first],
            ["--config", os.path.join(cls.first, "config.toml"), "--out_dir", cls.replay],
        ):
            run = forked(args, 2)
            assert run.returncode == 0, f"{run.codes}\n{run.stdout[-2000:]}\n" + "\n".join(run.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_replay_logs_the_same_bits(self):
        first, replay = steps_of(self.first), steps_of(self.replay)
        self.assertEqual(sorted(replay), list(range(1, STEPS + 1)))
        self.assertEqual(
            [(r["loss"], r["grad_norm"]) for r in replay.values()],
            [(r["loss"], r["grad_norm"]) for r in first.values()],
        )
        self.assertEqual(evals_of(self.replay), evals_of(self.first))
        self.assertLess(first[STEPS]["loss"], first[1]["loss"] - 0.5)  # it trained: the bits compared are a run's

    def test_the_replay_writes_the_same_config_but_its_out_dir(self):
        def lines(run: str) -> list[str]:
            with open(os.path.join(run, "config.toml")) as f:
                return [ln for ln in f.read().splitlines() if not ln.startswith("out_dir = ")]

        self.assertEqual(lines(self.replay), lines(self.first))
        self.assertIn("tensor_parallel_size = 2", lines(self.first))


if __name__ == "__main__":
    unittest.main()
